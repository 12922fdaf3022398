"""Helpers for multi-process tests: gloo ranks in fresh processes (megalite.parallel.spawn), and
pretrain_gpt.py under torchrun with its metrics file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megalite.parallel.spawn import run_on_ranks as run_ranks  # noqa: F401  (re-exported for the tests)


ROOT = Path(__file__).resolve().parents[1]


def pretrain_torchrun(nproc: int, args: list[str], timeout: int = 600) -> None:
    """Run pretrain_gpt.py under torchrun on `nproc` CPU processes (one thread each); fail with its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "pretrain_gpt.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def metrics(path: Path) -> list[dict]:
    """The training-step records of a metrics file (evaluation records left out)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
