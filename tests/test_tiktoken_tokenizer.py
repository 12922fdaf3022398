"""Kimi K2's / Moonlight's tiktoken tokenizer directory, read without its remote code (data/tiktoken_dir.py).

A small tiktoken BPE file is trained here over bytes (Han, Latin, Cyrillic, digits, punctuation, newlines), beside a
tokenizer_config.json with Kimi K2's special tokens at their published offsets after the ranks and a
tokenization_kimi.py that fails if anything runs it. megalite's tokenizer encodes and decodes a mixed text exactly
as tiktoken.Encoding with Kimi's pattern (the independent reference); preprocessing a jsonl yields those ids; the
directory travels with a converted checkpoint (remote code copied, never run) and every bad file is named.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import pytest
import regex
import tiktoken
import torch
import transformers
from test_hf_convert import convert
from test_preprocess_data import documents, run_tool, write_jsonl

from megalite.checkpoint.hf_tokenizer import hf_tokenizer, keep_tokenizer, save_tokenizer
from megalite.config import DataConfig
from megalite.data.tiktoken_dir import KIMI_PATTERN, load_pretrained_tokenizer
from megalite.data.tokenizers import HuggingFaceTokenizer
from megalite.errors import InvalidInput, MissingInput
from megalite.inference.generate import load_model

CORPUS = ("The quick brown fox's den; THE QUICK FOXES'LL jump 1234567 times!\n\n"
          "我们在北京学习机器学习。机器学习很有趣，我们学习。\n  indented  code: x = 42; y=3.14\r\n"
          "Ünïcödé naïve café résumé — “quotes” ПРИВЕТ мир\tTabs\n def f(x):\n    return x  # I'm done\n") * 3
MIXED = ("Hello 世界！ It's 2025-06-30, THE END'S near: 123456789.\n\n\n  \u3000 中文English混合 ПРИВЕТ мир 😀\r\n"
         "[BOS]say<|im_end|>\t<|im_user|>x[EOS] Ünïcödé e\u0301 \u00a0 def f(x):\n    return x  # ok\n")
# Kimi K2's special tokens: offset after the BPE ranks -> name (its tokenizer_config.json's added_tokens_decoder)
KIMI_SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """tiktoken ranks: the 256 bytes, then the most frequent adjacent pair of each step merged (ties by bytes),
    within the pieces Kimi's pattern cuts (the `regex` module needs V1 for its `&&`)."""
    words = Counter(piece.encode() for piece in regex.findall("(?V1)" + KIMI_PATTERN, text))
    ranks = {bytes([b]): b for b in range(256)}
    parts = {word: [bytes([b]) for b in word] for word in words}
    for _ in range(merges):
        pairs = Counter()
        for word, p in parts.items():
            for pair in zip(p, p[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        ranks[best[0] + best[1]] = len(ranks)
        for p in parts.values():
            i = 0
            while i < len(p) - 1:
                p[i:i + 2] = [p[i] + p[i + 1]] if (p[i], p[i + 1]) == best else p[i:i + 2]
                i += 1
    return ranks


def write_kimi_dir(directory: Path, ranks: dict[bytes, int], **config) -> Path:
    """A tokenizer directory as Kimi K2 publishes it, with a remote-code module that fails if it is run."""
    directory.mkdir(parents=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(len(ranks) + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for offset, name in KIMI_SPECIAL.items()}
    settings = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
                "pad_token": "[PAD]", "additional_special_tokens": ["<|im_end|>", "<|im_user|>"],
                "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}} | config
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    (directory / "tokenization_kimi.py").write_text("raise RuntimeError('megalite ran remote code')\n")
    return directory


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(CORPUS, 300)


@pytest.fixture(scope="module")
def reference(ranks) -> tiktoken.Encoding:
    """What Kimi's remote code builds: tiktoken with its pattern, 256 special ids after the ranks."""
    names = {len(ranks) + i: KIMI_SPECIAL.get(i, f"<|reserved_token_{len(ranks) + i}|>") for i in range(256)}
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens={name: i for i, name in names.items()})


@pytest.fixture(scope="module")
def kimi_dir(ranks, tmp_path_factory) -> Path:
    return write_kimi_dir(tmp_path_factory.mktemp("kimi") / "tokenizer", ranks)


def test_ids_equal_tiktoken_with_kimis_pattern_and_special_tokens(ranks, reference, kimi_dir):
    ours = HuggingFaceTokenizer(str(kimi_dir))
    base = len(ranks)
    reserved = f"<|reserved_token_{base + 100}|>"
    for text in (MIXED, CORPUS, MIXED + reserved, " ", "\n\n"):
        expected = reference.encode(text, allowed_special="all")
        assert ours.encode(text) == expected and ours.decode(expected) == reference.decode(expected) == text
    assert ours.encode_batch([MIXED, CORPUS]) == [ours.encode(MIXED), ours.encode(CORPUS)]
    assert len(ours.encode(CORPUS)) < len(CORPUS.encode()) / 4  # the merges are used: not a byte-per-id encoding
    assert ours.encode("[BOS]<|im_end|>[PAD]" + reserved) == [base, base + 2, base + 255, base + 100]
    assert ours.vocab_size == base + 256 and ours.eod == base + 1  # eos_token [EOS] ends documents
    hf = load_pretrained_tokenizer(kimi_dir)
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id) == (base, base + 1, base + 254,
                                                                                   base + 255)
    assert hf.decode(hf.encode(MIXED), skip_special_tokens=True) == reference.decode(
        [i for i in reference.encode(MIXED, allowed_special="all") if i < base])


def test_preprocessing_a_jsonl_yields_tiktokens_ids(reference, kimi_dir, tmp_path):
    texts = [MIXED, "我们学习。", CORPUS[:300]]
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    assert run_tool("--input", source, "--output-prefix", tmp_path / "kimi", "--tokenizer-type",
                    "HuggingFaceTokenizer", "--tokenizer-model", kimi_dir, "--append-eod", "--workers", 1) == 0
    eos = reference.encode_single_token("[EOS]")
    assert documents(tmp_path / "kimi_text_document") == [reference.encode(t, allowed_special="all") + [eos]
                                                          for t in texts]


def test_the_directory_travels_with_a_checkpoint_byte_for_byte(reference, kimi_dir, tmp_path):
    """--from-hf keeps it under the checkpoint (remote code copied, not run), training reads it from there and
    --to-hf writes it back unchanged, with its bos / eos ids for the model's config."""
    fields = keep_tokenizer(load_pretrained_tokenizer(kimi_dir), tmp_path / "checkpoint", kimi_dir)
    data = DataConfig(**fields)
    kept = Path(data.tokenizer_model)
    assert HuggingFaceTokenizer(str(kept)).encode(MIXED) == reference.encode(MIXED, allowed_special="all")
    exported = hf_tokenizer(data, reference.n_vocab, "config.yaml")
    assert (exported.bos_token_id, exported.eos_token_id) == (reference.encode_single_token("[BOS]"),
                                                              reference.encode_single_token("[EOS]"))
    save_tokenizer(exported, data, tmp_path / "hf_out")
    names = ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py")
    assert sorted(p.name for p in (tmp_path / "hf_out").iterdir()) == sorted(names)
    assert all((tmp_path / "hf_out" / n).read_bytes() == (kimi_dir / n).read_bytes() for n in names)


def test_a_kimi_k2_directory_converts_with_its_tokenizer_both_ways(ranks, reference, kimi_dir, tmp_path):
    """A tiny `model_type: kimi_k2` model directory (its config and tokenizer read without remote code) converts in
    with the tokenizer kept and read from the checkpoint, and out with the tokenizer files unchanged and its bos /
    eos ids in config.json."""
    config = transformers.DeepseekV3Config(
        vocab_size=reference.n_vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf_in")
    written = json.loads((tmp_path / "hf_in" / "config.json").read_text())
    kimi = written | {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
                      "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    (tmp_path / "hf_in" / "config.json").write_text(json.dumps(kimi))
    for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"):
        (tmp_path / "hf_in" / name).write_bytes((kimi_dir / name).read_bytes())
    convert("--from-hf", "--load", str(tmp_path / "hf_in"), "--save", str(tmp_path / "megalite"))
    _, cfg, tokenizer = load_model(tmp_path / "megalite", torch.device("cpu"))
    assert cfg.data.tokenizer_type == "HuggingFaceTokenizer" and cfg.model.multi_latent_attention
    assert tokenizer.encode(MIXED) == reference.encode(MIXED, allowed_special="all")
    assert tokenizer.eod == reference.encode_single_token("[EOS]")
    convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / "hf_out"))
    for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"):
        assert (tmp_path / "hf_out" / name).read_bytes() == (kimi_dir / name).read_bytes()
    exported = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (len(ranks), len(ranks) + 1)


def test_bad_tiktoken_directories_are_named_with_the_fix(ranks, tmp_path):
    def error(directory: Path) -> str:
        with pytest.raises((InvalidInput, MissingInput)) as caught:
            HuggingFaceTokenizer(str(directory))
        return str(caught.value)

    bad_line = write_kimi_dir(tmp_path / "bad_line", ranks)
    with open(bad_line / "tiktoken.model", "a") as f:
        f.write("not-base64! 7\n")
    assert f"{bad_line / 'tiktoken.model'}:{len(ranks) + 1}: " in error(bad_line)
    gap = write_kimi_dir(tmp_path / "gap", {token: rank + (rank == len(ranks) - 1) for token, rank in ranks.items()})
    assert "are not 0.." in error(gap)
    inside = write_kimi_dir(tmp_path / "inside", ranks, added_tokens_decoder={"5": {"content": "[EOS]"}})
    assert "added_tokens_decoder['5'] must be a special token's id at or after" in error(inside)
    unknown = write_kimi_dir(tmp_path / "unknown", ranks, eos_token="<|endoftext|>")
    assert "eos_token '<|endoftext|>' is not among the special tokens" in error(unknown)
    other = write_kimi_dir(tmp_path / "other", ranks, tokenizer_class="QWenTokenizer")
    assert "tokenizer_class 'QWenTokenizer'" in error(other)
    missing = write_kimi_dir(tmp_path / "missing", ranks)
    (missing / "tiktoken.model").unlink()
    assert f"{missing / 'tiktoken.model'} does not exist" in error(missing)
