"""Training on a preprocessed Megatron corpus: splits, blending, EOD options, exact resume,
and data parallelism equal to one process (the sample order does not depend on dp)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import tiny_config
from corpus import VOCAB, write_corpus
from distributed import metrics as read_metrics
from distributed import pretrain_each, run_ranks

from megalite.training.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]


def _data(paths: list[str], **extra) -> dict:
    return {"mock": False, "paths": paths, "tokenizer_type": "NullTokenizer", "num_workers": 0, **extra}


def test_trains_on_a_blend_with_validation(tmp_path):
    a, b = write_corpus(tmp_path / "a", 300, 1), write_corpus(tmp_path / "b", 200, 2)
    cfg = tiny_config(data=_data(["0.7", a, "0.3", b], split="90,10,0", eod_mask_loss=True, reset_position_ids=True),
                      train={"train_iters": 6, "eval_interval": 3, "eval_iters": 2},
                      checkpoint={"save": str(tmp_path / "ckpt")})
    result = pretrain(cfg)
    assert len(result.losses) == 6 and all(math.isfinite(l) for l in result.losses.values())
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    assert f"vocab_size: {VOCAB + 1}" in (result.checkpoint / "config.yaml").read_text()
    assert any(p.suffix == ".npy" for p in (tmp_path / "cache").iterdir())


def test_resume_on_real_data_with_workers(tmp_path):
    corpus = write_corpus(tmp_path / "c", 300, 3)
    data = _data([corpus], num_workers=2)
    straight = pretrain(tiny_config(data=data, train={"train_iters": 6})).losses
    ckpt = {"save": str(tmp_path / "ckpt"), "load": str(tmp_path / "ckpt")}
    first = pretrain(tiny_config(data=data, train={"train_iters": 6, "exit_interval": 2}, checkpoint=ckpt)).losses
    second = pretrain(tiny_config(data=data, train={"train_iters": 6}, checkpoint=ckpt)).losses
    assert {**first, **second} == straight


def test_separate_train_and_valid_paths(tmp_path):
    train, valid = write_corpus(tmp_path / "t", 200, 4), write_corpus(tmp_path / "v", 50, 5)
    cfg = tiny_config(data={**_data(None), "paths": None, "train_paths": [train], "valid_paths": [valid]},
                      train={"train_iters": 2, "eval_interval": 2, "eval_iters": 1})
    assert pretrain(cfg).val_loss is not None


def _spawned(nproc: int, metrics: Path, corpus: str, cache: Path) -> list[float]:
    args = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
            f"--model.vocab_size={VOCAB}", "--train.micro_batch_size=1", "--train.global_batch_size=4",
            "--train.train_iters=3", "--logging.progress_bar=false", "--logging.log_interval=1",
            f"--logging.metrics_file={metrics}", f"--data.paths={corpus}", "--data.tokenizer_type=NullTokenizer",
            f"--data.cache_dir={cache}", "--data.num_workers=1"]
    run_ranks(nproc, pretrain_each, [args])
    return [r["loss"] for r in read_metrics(metrics)]


def test_data_parallel_reads_the_same_global_batches(tmp_path):
    corpus = write_corpus(tmp_path / "d", 300, 6)
    one = _spawned(1, tmp_path / "one.jsonl", corpus, tmp_path / "cache")
    two = _spawned(2, tmp_path / "two.jsonl", corpus, tmp_path / "cache")
    assert two == pytest.approx(one, abs=1e-5)
