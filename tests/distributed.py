"""Run a function on N gloo ranks in fresh processes (one intra-op thread each) and collect
what each rank returns."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size, join=True)
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]


ROOT = Path(__file__).resolve().parents[1]


def pretrain_torchrun(nproc: int, args: list[str], timeout: int = 600) -> None:
    """Run pretrain_gpt.py under torchrun on `nproc` CPU processes (one thread each); fail with its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "pretrain_gpt.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def metrics(path: Path) -> list[dict]:
    """The training-step records of a metrics file (evaluation records left out)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
