"""The vocabulary a model embeds (training/vocabulary.py). Released models embed more rows than their tokenizer has
ids (Qwen3-8B: 151936 rows, 151669 ids); the tokenizer once set model.vocab_size whatever the config or the
checkpoint said, so continuing such a model was refused as "saved with another model config". Here a tiny Qwen3
of 1100 rows stands for it, with a 1000-id SentencePiece tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import transformers
import yaml

from megalite.checkpoint.compatibility import CheckpointMismatch, check_model
from megalite.checkpoint.hf_convert import hf_to_megalite
from megalite.config import Config
from megalite.config_cli import parse_config
from megalite.data.gpt_dataset import TokenOutOfVocabulary
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.data.tokenizers import build_tokenizer
from megalite.training.launch_check import check_launch
from megalite.training.pretrain import pretrain
from megalite.training.vocabulary import VocabularyTooSmall, set_vocabulary

ROWS = 1100  # the checkpoint's embedding rows; the tokenizer's ids are 1000
TOKENIZER = "assets/sentencepiece/botchan_en_bpe_1000.model"
SENTENCEPIECE = {"type": "SentencePieceTokenizer", "vocab_size": 1000}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, assets) -> Path:
    """A tiny Qwen3 of ROWS embedding rows, converted from Hugging Face; its corpus beside it."""
    root = tmp_path_factory.mktemp("vocab")
    config = transformers.Qwen3Config(vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(root / "hf")
    hf_to_megalite(root / "hf", root / "ckpt")
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(assets / "sentencepiece/"
                                                                                    "botchan_en_bpe_1000.model"))
    lines = [line for line in (assets / "sentencepiece/botchan.txt").read_text().splitlines() if line.strip()]
    _write(root / "corpus", [np.array(tokenizer.encode(line) + [tokenizer.eod]) for line in lines[:200]])
    return root


def _write(prefix: Path, documents: list[np.ndarray]) -> str:
    with IndexedDatasetWriter(str(prefix), np.uint16, SENTENCEPIECE) as writer:
        writer.add_documents(documents)
    return str(prefix)


def _continue(root: Path, *overrides: str) -> Config:
    """The README's continue recipe: the converter's config.yaml, the checkpoint, the model's tokenizer."""
    return parse_config(["--config", str(root / "ckpt/iter_0000000/config.yaml"), f"--checkpoint.load={root / 'ckpt'}",
                         f"--checkpoint.save={root / 'trained'}", f"--data.paths={root / 'corpus'}",
                         "--data.mock=false", "--data.split=1,0,0", "--data.num_workers=0",
                         "--data.tokenizer_type=SentencePieceTokenizer", f"--data.tokenizer_model={TOKENIZER}",
                         "--model.seq_length=32", "--train.micro_batch_size=2", "--train.global_batch_size=2",
                         "--train.train_iters=1", "--logging.progress_bar=false", *overrides])


def test_continuing_a_converted_model_keeps_its_embedding_rows(converted):
    """The converter's model.vocab_size (1100) is kept with a tokenizer of 1000 ids, and so is the checkpoint's when
    the config leaves it unset; once refused: "model.vocab_size=1100 in the checkpoint, 1000 here"."""
    lines = check_launch(_continue(converted), 1, 1, [])
    assert lines[1] == (f"tokenizer: data.tokenizer_type=SentencePieceTokenizer data.tokenizer_model={TOKENIZER}, "
                        "1000 ids; model.vocab_size=1100 (set in the config)")
    assert lines[3] == (f"checkpoint: resumes from {converted}/ckpt/iter_0000000, model changes: "
                        "model.seq_length 64 -> 32")
    result = pretrain(_continue(converted))
    assert result.final_step == 1
    assert yaml.safe_load((result.checkpoint / "config.yaml").read_text())["model"]["vocab_size"] == ROWS
    unset = _continue(converted, "--model.vocab_size=null", f"--checkpoint.save={converted / 'ckpt'}")
    assert set_vocabulary(unset)[1] == f"the checkpoint's, {converted}/ckpt/iter_0000000"
    assert unset.model == _continue(converted).model  # the model the run above built


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_naming_both(converted):
    with pytest.raises(VocabularyTooSmall, match=rf"^data.tokenizer_type=SentencePieceTokenizer data.tokenizer_model="
                                                 rf"{TOKENIZER} has 1000 ids \(largest 999\), more than model."
                                                 r"vocab_size=900: ids from 900 on have no embedding row. Fix: set "
                                                 r"model.vocab_size to at least 1000, or leave it unset"):
        set_vocabulary(_continue(converted, "--model.vocab_size=900"))
    gpt2 = ["--data.tokenizer_type=GPT2BPETokenizer", "--data.vocab_file=assets/gpt2/vocab.json",
            "--data.merge_file=assets/gpt2/merges.txt", f"--checkpoint.save={converted / 'ckpt'}"]
    with pytest.raises(VocabularyTooSmall, match=rf"has 50257 ids \(largest 50256\), more than the 1100 checkpoint "
                                                 rf"{converted}/ckpt/iter_0000000 embeds \(model.vocab_size in its "
                                                 r"config.yaml\): ids from 1100 on have no embedding row. Fix: train "
                                                 r"with the tokenizer the checkpoint was made with"):
        set_vocabulary(_continue(converted, "--model.vocab_size=null", *gpt2))


def test_another_vocabulary_than_the_checkpoints_is_refused_at_resume(converted):
    cfg = _continue(converted, "--model.vocab_size=1000")
    assert set_vocabulary(cfg)[1] == "set in the config"
    with pytest.raises(CheckpointMismatch, match=r"model.vocab_size=1100 in the checkpoint, 1000 here \(leave "
                                                 r"model.vocab_size unset to keep the checkpoint's"):
        check_model(converted / "ckpt/iter_0000000", cfg.model)


def test_corpus_ids_beyond_the_tokenizer_are_refused_though_the_model_embeds_them(converted, tmp_path):
    """Id 1050 has an embedding row (1100) but no token of this tokenizer (1000): another tokenizer's corpus."""
    prefix = _write(tmp_path / "other", [np.array([5, 1050, 7] * 20)])
    with pytest.raises(TokenOutOfVocabulary, match=rf"^{prefix} \(by {prefix}.stats.json, written by preprocessing\) "
                                                   r"holds token id 1050, outside the vocabulary of 1000 ids of "
                                                   r"data.tokenizer_type=SentencePieceTokenizer"):
        pretrain(_continue(converted, f"--data.paths={prefix}"))


def test_a_fresh_run_takes_the_tokenizers_vocabulary_unless_the_config_sets_one(assets):
    tokenizer = [f"--data.paths={assets}/x", "--data.mock=false", "--data.tokenizer_type=SentencePieceTokenizer",
                 f"--data.tokenizer_model={TOKENIZER}"]
    fresh = parse_config(tokenizer)
    assert set_vocabulary(fresh)[1] == "the tokenizer's" and fresh.model.vocab_size == 1000
    larger = parse_config([*tokenizer, "--model.vocab_size=1024"])
    assert set_vocabulary(larger)[1] == "set in the config" and larger.model.vocab_size == 1024
    null = parse_config(["--data.mock=false", "--data.tokenizer_type=NullTokenizer", "--model.vocab_size=300"])
    assert set_vocabulary(null)[1].startswith("NullTokenizer") and null.model.vocab_size == 301
    mock = parse_config(["--data.mock=true"])
    assert set_vocabulary(mock) == (None, "the default, for mock data") and mock.model.vocab_size == 50257
    assert Config().model.vocab == Config().model.padded_vocab_size - 47 == 50257
