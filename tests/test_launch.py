"""Launch through torchrun: one process, and two data-parallel processes (gloo) whose
global-batch losses equal the one-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import tiny_run

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
    "--model.vocab_size=300", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=4",
    "--logging.log_interval=1", "--logging.progress_bar=false", "--data.mock=true",
]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_data_parallel_matches_one_process(tmp_path, family):
    one = tiny_run(tmp_path, 1, f"--model.family={family}", base=TINY, torchrun=True)
    two = tiny_run(tmp_path, 2, f"--model.family={family}", base=TINY, torchrun=True)
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
