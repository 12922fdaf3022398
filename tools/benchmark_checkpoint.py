"""How long training stalls for a checkpoint: synchronous save vs `checkpoint.async_save`.

Why: an asynchronous save should stop training only for as long as it takes to copy the state
to host memory; the files are written (and fsynced, and published) by a background thread.
This tool builds a GPT-2 125M (examples/gpt2_125m.yaml: 12 layers, hidden 768, 12 heads,
vocabulary 50257 padded to 50304, seq 1024; bf16 parameters with fp32 main weights as there),
in one process, trains one step with micro batch 1 on mock data so that Adam's state exists,
and then times, with megalite's own `Checkpointer`:

  - synchronous save: `Checkpointer(async_save=False).save()`, which returns once the checkpoint
    is written, fsynced, renamed and `latest` updated;
  - asynchronous save: the stall (until `save()` returns: host copy of every piece, the barrier,
    the config and state files) and the total (until `wait()` has published the checkpoint);
  - while the background write runs, how long the training thread is held up: a loop of small
    Python work stands in for it, and pauses between its rounds longer than 20 ms (the writer
    holding the GIL or the CPU) are added up;
  - the host copy alone (`tensor.to("cpu", copy=True)` of every piece `save` writes).

Repeats alternate sync and async so that load from other processes falls on both alike; the
medians are reported. Each checkpoint is deleted after it is timed (outside the timing).

    python tools/benchmark_checkpoint.py                          # 5 repeats, in a temporary directory
    python tools/benchmark_checkpoint.py --repeats 3 --dir /scratch --param-dtype fp32
    python tools/benchmark_checkpoint.py --append docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint.local import Checkpointer, TrainingState, rng_state
from megalite.config import Config
from megalite.config_cli import dump_yaml
from megalite.parallel.topology import Topology, release_process_groups
from megalite.planning.measure import measurement_config, mock_batches, param_dtype_fields
from megalite.training.build import build_trainer
from megalite.training.step import train_step

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples" / "gpt2_125m.yaml"),
                   help="model config (YAML, as pretrain_gpt.py takes)")
    p.add_argument("--param-dtype", choices=("bf16", "fp32"),
                   help="train.param_dtype (bf16 also sets bf16 precision); default: the config's")
    p.add_argument("--repeats", type=int, default=5, help="timed saves of each kind")
    p.add_argument("--dir", help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--append", help="append the results as a markdown section to this file")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """The model of args.config in one process, one sample per step."""
    return measurement_config(1, args.config, parallel={"tp": 1, "pp": 1, "vp": 1},
                              train={"micro_batch_size": 1, "global_batch_size": 1,
                                     **param_dtype_fields(args.param_dtype)})


class Trained:
    """The model, optimizer and sharded state after one training step (one process)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.topology = Topology.from_environment("cpu", cfg.parallel)
        torch.manual_seed(cfg.train.seed)
        batches = mock_batches(cfg, 1)
        with build_trainer(cfg, self.topology) as parts:
            begin = time.perf_counter()
            train_step(parts, batches)
            self.step_seconds = time.perf_counter() - begin
        self.sharded = parts.sharded_state()
        self.rng = rng_state(self.topology.device, parts.ctx.rng)
        self.state = TrainingState(step=1, consumed_samples=1, loss_scaler=parts.scaler.state_dict())
        self.params = sum(p.numel() for p in parts.model.parameters())
        self.yaml = dump_yaml(cfg)

    def save(self, root: Path, async_save: bool) -> dict[str, float]:
        """Seconds until save() returned and until the checkpoint was published, bytes written, and
        how long the training thread was held up while the background write ran."""
        checkpointer = Checkpointer(str(root), self.topology, async_save=async_save)
        begin = time.perf_counter()
        path = checkpointer.save(self.state, self.sharded, self.yaml, self.rng)
        returned = time.perf_counter()
        held = held_up_while(checkpointer.pending.thread if checkpointer.pending else None)
        checkpointer.wait()
        done = time.perf_counter()
        written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return {"stall": returned - begin, "total": done - begin, "bytes": written, **held}

    def host_copy(self) -> float:
        begin = time.perf_counter()
        copies = [tensor.to("cpu", copy=True) for _, tensor in self.sharded.pieces()]
        seconds = time.perf_counter() - begin
        del copies
        return seconds


def held_up_while(writer: threading.Thread | None, pause: float = 0.02) -> dict[str, float]:
    """Stand in for the training loop while `writer` runs: do a little Python work over and over
    and record the pauses longer than `pause` seconds between two rounds (the writer holding the
    GIL, or taking the CPU). Returns the longest pause and the sum of such pauses."""
    longest = total = 0.0
    last = time.perf_counter()
    while writer is not None and writer.is_alive():
        sum(range(200))  # what a training loop does between kernels: Python
        now = time.perf_counter()
        if now - last > pause:
            longest, total = max(longest, now - last), total + (now - last)
        last = now
    return {"longest_pause": longest, "paused": total}


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"`lscpu` model name \"{model}\", {os.cpu_count()} cores, {memory:.0f} GiB memory, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"intra-op threads: {torch.get_num_threads()}")


def filesystem(path: Path) -> str:
    """The file system type and device of `path`, as df reports them."""
    try:
        line = (subprocess.run(["df", "-T", str(path)], check=False, capture_output=True, text=True)
                .stdout.splitlines()[1].split())
        return f"{line[1]} on {line[0]}"
    except (OSError, IndexError):
        return "an unknown file system"


def measure(args: argparse.Namespace) -> dict:
    cfg = build_config(args)
    load_before = os.getloadavg()
    created = not dist.is_initialized()
    trained = Trained(cfg)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="megalite-ckpt-bench-"))
    results = {"sync": [], "async_stall": [], "async_total": [], "host_copy": [], "longest_pause": [], "paused": []}
    written = 0
    try:
        for i in range(args.repeats):
            for async_save in (False, True):
                root = base / f"{'async' if async_save else 'sync'}_{i}"
                timed = trained.save(root, async_save)
                shutil.rmtree(root)
                written = timed["bytes"]
                if async_save:
                    for key in ("stall", "total", "longest_pause", "paused"):
                        results[key if "pause" in key else f"async_{key}"].append(timed[key])
                else:
                    results["sync"].append(timed["total"])
                print(f"repeat {i + 1}: {'async' if async_save else 'sync '} save() returned after "
                      f"{timed['stall']:.3f} s, published after {timed['total']:.3f} s; training thread paused "
                      f"{timed['paused']:.3f} s "
                      f"(longest {timed['longest_pause']:.3f} s)", flush=True)
            results["host_copy"].append(trained.host_copy())
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
        trained.topology = None
        if created:
            release_process_groups()
    m = cfg.model
    contents = "bf16 parameters, fp32 main weights" if cfg.train.param_dtype != "fp32" else "fp32 parameters"
    return {"results": results, "written": written, "contents": contents,
            "config": os.path.relpath(args.config, ROOT), "filesystem": filesystem(base.parent),
            "params": trained.params, "step_seconds": trained.step_seconds,
            "where": str(base), "load": (load_before, os.getloadavg()),
            "model": f"{m.family}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
                     f"vocab {m.vocab_size} (padded {m.padded_vocab_size}), seq {m.seq_length}; "
                     f"train.param_dtype={cfg.train.param_dtype}"}


def markdown(measured: dict, argv: list[str]) -> str:
    r, median = measured["results"], statistics.median
    gib = measured["written"] / 2**30
    rows = [("synchronous save (`save()` returns when published)", r["sync"]),
            ("asynchronous save: stall (`save()` returns)", r["async_stall"]),
            ("asynchronous save: until published (`wait()` returns)", r["async_total"]),
            ("asynchronous save: training thread paused while the files were written (sum of pauses > 20 ms)",
             r["paused"]),
            ("asynchronous save: the longest of those pauses", r["longest_pause"]),
            ("host copy of the state alone", r["host_copy"])]
    table = "\n".join(f"| {name} | {median(values):.3f} | {min(values):.3f}-{max(values):.3f} |"
                      for name, values in rows)
    (a1, a5, a15), (b1, b5, b15) = measured["load"]
    command = " ".join(["python tools/benchmark_checkpoint.py", *map(shlex.quote, argv)])
    return f"""
# Checkpoint saving: synchronous vs asynchronous (stall per save)

`tools/benchmark_checkpoint.py` builds the model of `{measured["config"]}` in one process,
trains one step (micro batch 1, mock data) so that Adam's state exists, and times megalite's
`Checkpointer` saving it: synchronously (written, fsynced, renamed, `latest` updated before
`save()` returns), and with `checkpoint.async_save`, where `save()` returns after copying every
piece to host memory and a background thread writes the files; `wait()` returns once the
checkpoint is published. Sync and async saves alternate; medians of {len(r["sync"])} each.

```bash
{command}
```

Machine: {machine()}. Model: {measured["model"]}, {measured["params"] / 1e6:.1f}M parameters; one
checkpoint is {gib:.2f} GiB ({measured["contents"]}, two fp32 Adam moments, RNG, config), written
to {measured["filesystem"]} (`{measured["where"]}`). The machine is
shared with other jobs: load average {a1:.1f} / {a5:.1f} / {a15:.1f} (1/5/15 min) before, {b1:.1f} /
{b5:.1f} / {b15:.1f} after; the training step took {measured["step_seconds"]:.1f} s.

| what | median s | range s |
|---|---|---|
{table}

The training loop stalls {median(r["async_stall"]):.2f} s per asynchronous save instead of
{median(r["sync"]):.2f} s for a synchronous one ({median(r["sync"]) / median(r["async_stall"]):.0f}x less). The stall is
the copy of the state to host memory (measured alone: {median(r["host_copy"]):.2f} s; on a GPU, the
device-to-host copy) plus a barrier and the small config and state files. The {gib:.2f} GiB of
files are written in the background, which takes about as long as a synchronous save
({median(r["async_total"]):.2f} s until published); training continues meanwhile, and the next save
or the end of training waits for it. To see what the background write costs the training thread,
the benchmark runs a loop of small Python work in its place until the write is done and adds up
the pauses between rounds longer than 20 ms (the writer holding the GIL or the CPU): {median(r["paused"]):.2f} s
per save (median), the longest single pause {median(r["longest_pause"]):.2f} s.
"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    measured = measure(args)
    text = markdown(measured, [a for a in argv if not a.startswith("--append") and a != args.append])
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
