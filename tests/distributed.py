"""Helpers for multi-process tests: gloo ranks in fresh processes (megalite.parallel.spawn), and
pretrain_gpt.py under torchrun, or its runs in spawned ranks (`pretrain_each`), with its metrics file (`tiny_run`
for a test file's tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megalite.config import Config
from megalite.config_cli import parse_config
from megalite.parallel.spawn import run_on_ranks as run_ranks  # noqa: F401  (re-exported for the tests)
from megalite.parallel.topology import Topology

ROOT = Path(__file__).resolve().parents[1]


def cpu_topology(rank: int, world_size: int, cfg: Config | None = None, **sizes: int) -> Topology:
    """The topology a spawned gloo rank works in: `cfg`'s layout (Topology.from_config), or the axis sizes
    given (tp=, pp=, cp=, ...; the rest 1), on the CPU."""
    if cfg is not None:
        return Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel, cfg.model.num_experts > 0)
    return Topology(rank, world_size, torch.device("cpu"), **sizes)


def pretrain_torchrun(nproc: int, args: list[str], timeout: int = 600) -> None:
    """Run pretrain_gpt.py under torchrun on `nproc` CPU processes (one thread each); fail with its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "pretrain_gpt.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def pretrain_each(rank: int, world_size: int, runs: list[list[str]]) -> None:
    """pretrain_gpt.py's run for each argument list in turn, in a group spawned by run_ranks (which pretrain joins):
    several short runs for the price of one start of the processes."""
    from megalite.training.pretrain import pretrain  # the training stack takes seconds to import: only where it runs

    os.environ["WORLD_SIZE"] = str(world_size)  # what pretrain validates the layout against, as under torchrun
    for args in runs:
        pretrain(parse_config(args))


def metrics(path: Path) -> list[dict]:
    """The training-step records of a metrics file (evaluation records left out)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def tiny_run(tmp_path: Path, nproc: int, *extra: str, base: list[str], name: str = "",
             torchrun: bool = False) -> list[dict]:
    """One short run of a test file's tiny model: its `base` arguments, a metrics file under tmp_path
    named by nproc and `name` (or the number of extras), then `extra`, which win; returns the records. It runs
    in ranks spawned from the preloaded fork server (`pretrain_each`: the same training, without torchrun's
    launcher and each rank's imports, seconds per run), or under torchrun when that is what a test is about."""
    path = tmp_path / f"metrics-{nproc}-{name or len(extra)}.jsonl"
    args = [*base, f"--logging.metrics_file={path}", *extra]
    if torchrun:
        pretrain_torchrun(nproc, args)
    else:
        run_ranks(nproc, pretrain_each, [args])
    return metrics(path)
