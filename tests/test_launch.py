"""Launch through torchrun: one process, and two data-parallel processes (gloo) whose
global-batch losses equal the one-process run."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import metrics as read_metrics, pretrain_torchrun

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
    "--model.vocab_size=300", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=4",
    "--logging.log_interval=1", "--logging.progress_bar=false", "--data.mock=true",
]


def _torchrun(nproc: int, metrics: Path, *extra: str) -> list[dict]:
    pretrain_torchrun(nproc, [*TINY, f"--logging.metrics_file={metrics}", *extra])
    return read_metrics(metrics)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_data_parallel_matches_one_process(tmp_path, family):
    one = _torchrun(1, tmp_path / "one.jsonl", f"--model.family={family}")
    two = _torchrun(2, tmp_path / "two.jsonl", f"--model.family={family}")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
