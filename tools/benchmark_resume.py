"""Resume I/O: how many bytes each rank reads, and how long its load takes, when a checkpoint saved
at one layout resumes at another; and what that means for a 70B run.

Why: a resume used to rebuild every global tensor on every rank (each rank read its whole pipeline
stage, dp * tp times over) after rank 0 alone had read the whole checkpoint to check its CRCs while
the others waited in a collective with a 10-minute timeout. Now each rank reads only the byte ranges
it holds and verifies only those (checkpoint/reader.py).

The model is examples/gpt2_125m.yaml or examples/gpt2_1.3b.yaml (bf16 parameters with fp32 main
weights and the distributed optimizer, as there). gloo ranks on this machine play the job's ranks;
to fit the 1.3B model's optimizer state in host memory they build, save and load one at a time
(turns, separated by barriers). Adam's state is created by one optimizer step on zero gradients.
Before each load the page cache is dropped (when this process may), so reads come from the disk.
A rank's load time is what it would take in a real job, where ranks read in parallel; the
resume takes as long as the slowest rank if the storage serves every rank at that rate.

    python tools/benchmark_resume.py --model 125m
    python tools/benchmark_resume.py --model 1.3b --dir /scratch
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint.files import finalize, write_rank_files, write_run_files
from megalite.checkpoint.local import TrainingState, load_checkpoint
from megalite.checkpoint.sharded_state import ShardedState
from megalite.config import Config
from megalite.config_cli import dump_yaml
from megalite.parallel.spawn import run_on_ranks
from megalite.parallel.topology import Topology
from megalite.planning.measure import measurement_config
from megalite.training.build import build_trainer

ROOT = Path(__file__).resolve().parents[1]
# (saved layout, [(world size, resumed layout), ...]) per model: dp * tp * pp ranks each.
PLANS = {
    "125m": ({"tp": 2, "pp": 2}, [(4, {"tp": 2, "pp": 2}), (8, {"tp": 2, "pp": 2}), (4, {"tp": 4}), (2, {"pp": 2}),
                                  (1, {})]),
    "1.3b": ({"pp": 8}, [(8, {"pp": 8}), (8, {"pp": 4}), (4, {"tp": 2, "pp": 2})]),
}
SAVE_WORLD = 8


def _config(model: str, layout: dict[str, int], world_size: int) -> Config:
    return measurement_config(world_size, ROOT / "examples" / f"gpt2_{model}.yaml", parallel=layout,
                              train={"micro_batch_size": 1, "global_batch_size": None})


def _named(layout: dict[str, int]) -> str:
    return " ".join(f"--parallel.{name}={size}" for name, size in layout.items()) or "one device"


def _rank_state(cfg: Config, topology: Topology) -> ShardedState:
    parts = build_trainer(cfg, topology)
    for m in parts.optimizer.shards():
        m.main.grad = torch.zeros_like(m.main)
    parts.optimizer.optimizer.step()  # creates Adam's state
    return parts.sharded_state()


def _in_turns(rank: int, world_size: int, work) -> object:
    """work() on one rank at a time, so that only one rank's state is in memory. After its turn a rank
    hands its freed heap back to the system (glibc keeps it otherwise, and eight ranks' leftovers of a
    1.3B model's state do not fit in 24 GiB)."""
    result = None
    for turn in range(world_size):
        if turn == rank:
            result = work()
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        dist.barrier()
    return result


def _save(rank: int, world_size: int, model: str, tmp: str) -> None:
    cfg = _config(model, PLANS[model][0], world_size)
    topology = Topology(rank, world_size, torch.device("cpu"), tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    _in_turns(rank, world_size, lambda: write_rank_files(Path(tmp), rank, _rank_state(cfg, topology).pieces(), None))
    if rank == 0:
        write_run_files(Path(tmp), dump_yaml(cfg), TrainingState(1, 0).__dict__)


def _drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _load(rank: int, world_size: int, model: str, layout: dict[str, int], path: str) -> tuple[int, float, bool]:
    cfg = _config(model, layout, world_size)
    topology = Topology(rank, world_size, torch.device("cpu"), tp=cfg.parallel.tp, pp=cfg.parallel.pp)

    def work() -> tuple[int, float, bool]:
        sharded = _rank_state(cfg, topology)
        cold = _drop_page_cache()
        begin = time.perf_counter()
        read = load_checkpoint(Path(path), sharded, topology)[3]
        return read, time.perf_counter() - begin, cold

    return _in_turns(rank, world_size, work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PLANS), default="125m")
    p.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temporary directory)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="megalite-resume-", dir=args.dir))
    try:
        final, tmp = work / "iter_0000001", work / "iter_0000001.tmp"
        tmp.mkdir()
        begin = time.perf_counter()
        run_on_ranks(SAVE_WORLD, _save, args.model, str(tmp))
        finalize(tmp, final)
        size = sum(f.stat().st_size for f in final.glob("rank_*.safetensors"))
        print(f"GPT-2 {args.model}, saved at {_named(PLANS[args.model][0])} on "
              f"{SAVE_WORLD} ranks: {size / 2**30:.2f} GiB in {time.perf_counter() - begin:.0f} s (CPU: {_cpu()})")
        print("| resumed at | ranks | bytes read per rank (min-max) | all ranks / checkpoint | slowest rank's load "
              "| per-rank rate |")
        print("|---|---|---|---|---|---|")
        for world, layout in PLANS[args.model][1]:
            results = run_on_ranks(world, _load, args.model, layout, str(final))
            reads, seconds = [r[0] for r in results], [r[1] for r in results]
            slow = max(range(world), key=lambda r: seconds[r])
            cache = "cold" if all(r[2] for r in results) else "page cache kept"
            print(f"| {_named(layout)} | {world} | "
                  f"{min(reads) / 2**30:.3f}-{max(reads) / 2**30:.3f} GiB | {sum(reads) / size:.2f} | "
                  f"{seconds[slow]:.1f} s ({cache}) | {reads[slow] / seconds[slow] / 2**30:.2f} GiB/s |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    main()
