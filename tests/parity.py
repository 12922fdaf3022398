"""The tiny torchrun runs that data-parallel and ZeRO tests compare with one device: four layers,
eight micro batches of one sample per step, clipping active (0.5, below every step's norm), small
buckets so every layer spans several."""

from __future__ import annotations

from pathlib import Path

from distributed import tiny_run

LLAMA = ["--model.family=llama", "--model.num_query_groups=4"]
TINY = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8", "--model.seq_length=32",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.global_batch_size=8", "--train.train_iters=5",
        "--optim.clip_grad=0.5", "--parallel.bucket_size=5000", "--logging.progress_bar=false",
        "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0"]


def clipped_run(tmp_path: Path, nproc: int, *extra: str, name: str = "") -> list[float]:
    """The step losses of one run of the tiny model on `nproc` processes, checking clipping was active."""
    records = tiny_run(tmp_path, nproc, *extra, base=TINY, name=name)
    assert all(r["grad_norm"] > 0.5 for r in records), "clipping must be active in these tests"
    return [r["loss"] for r in records]
