"""Step time and time spent waiting on the data-parallel gradient reduction, with
`parallel.overlap_grad_reduce` on and off, with and without the distributed optimizer.

Why: overlap launches each gradient bucket's reduction as soon as the last micro batch's
backward has produced it, so that the transfer runs while backward goes on; a step should then
wait less on communication than one that reduces everything after backward. This tool checks
that on 2 gloo ranks with 1 intra-op thread each. Each rank runs megalite's own `train_step`
on mock data; the wait is `grads.wait_seconds`, the time blocked in the reductions' wait()
after backward (with the distributed optimizer, the parameter all-gather after the update is in
the step time, not in the wait). A rank that finishes backward first also waits there for its
peer, which overlap cannot help, so the table shows the wait of the rank that waited least as
the transfer time left unhidden, next to the ranks' mean. "Reduction alone" is the same
reduction with no backward to hide behind (`grads.reduce()` right after a barrier).

The default model keeps the vocabulary small so that most gradients belong to the layers: the
word-embedding gradient is complete only at the very end of backward, so its bucket can never
overlap. Buckets are 2M elements (parallel.bucket_size; the 40M default would make this model
one bucket, which cannot start before backward ends).

    python tools/benchmark_overlap.py
    python tools/benchmark_overlap.py --layers 4 --hidden 768 --heads 12 --microbatches 8 --bucket-size 5000000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.config import Config
from megalite.data.batches import Batch
from megalite.parallel.spawn import run_on_ranks
from megalite.parallel.topology import Topology
from megalite.planning.measure import measurement_config, mock_batches, model_fields
from megalite.training.build import Trainer, build_trainer
from megalite.training.step import train_step

CASES = [(distributed, overlap) for distributed in (False, True) for overlap in (False, True)]
WORLD_SIZE = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4, help="micro batches per step and rank")
    p.add_argument("--bucket-size", type=int, default=2_000_000, help="parallel.bucket_size (elements)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 = autocast, as train.precision")
    p.add_argument("--iters", type=int, default=7, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, distributed: bool, overlap: bool) -> Config:
    """One case's validated config on WORLD_SIZE ranks."""
    parallel = {"distributed_optimizer": distributed, "overlap_grad_reduce": overlap, "bucket_size": args.bucket_size}
    return measurement_config(WORLD_SIZE, model=model_fields(args), parallel=parallel,
                              train={"micro_batch_size": args.micro_batch, "precision": args.precision,
                                     "global_batch_size": args.micro_batch * args.microbatches * WORLD_SIZE})


@dataclass
class Case:
    """One configuration's model, optimizer and timings on this rank."""

    cfg: Config
    parts: Trainer
    batches: list[Batch]
    timings: dict[str, list[float]] = field(default_factory=lambda: {"steps": [], "waits": [], "alone": []})

    @classmethod
    def build(cls, topology: Topology, cfg: Config, microbatches: int) -> Case:
        return cls(cfg, build_trainer(cfg, topology), mock_batches(cfg, microbatches, topology.dp_rank))

    def step(self, topology: Topology) -> tuple[float, float]:
        """One train_step after a barrier: (seconds, grads.wait_seconds)."""
        dist.barrier()
        start = time.perf_counter()
        train_step(self.parts, self.batches)
        return time.perf_counter() - start, self.parts.grads.wait_seconds

    def reduce_alone(self) -> float:
        """The reduction after a barrier, with no backward to hide it behind (the grads are zeros)."""
        self.parts.grads.zero()
        dist.barrier()
        self.parts.grads.reduce()
        return self.parts.grads.wait_seconds


def time_cases(topology: Topology, configs: list[Config], args: argparse.Namespace) -> list[dict]:
    """All configurations side by side, timed in turns (step i of each, then step i + 1), so that
    load from other processes on the machine spreads over all of them alike."""
    cases = [Case.build(topology, cfg, args.microbatches) for cfg in configs]
    for i in range(args.warmup + args.iters):
        for case in cases:
            seconds, wait = case.step(topology)
            if i >= args.warmup:
                case.timings["steps"].append(seconds)
                case.timings["waits"].append(wait)
    for _ in range(args.iters):
        for case in cases:
            case.timings["alone"].append(case.reduce_alone())
    for case in cases:
        case.parts.close()
    buffers = cases[0].parts.grads.buffers
    return [{**case.timings, "numel": sum(p.numel() for p in case.parts.model.parameters()),
             "buckets": sum(len(b.buckets) for b in buffers)} for case in cases]


def _rank_cases(rank: int, world_size: int, configs: list[Config], args: argparse.Namespace) -> list[dict]:
    return time_cases(Topology(rank, world_size, torch.device("cpu")), configs, args)


def row(distributed: bool, overlap: bool, ranks: list[dict]) -> str:
    """Medians over steps of: the slower rank's step time; the wait of the rank that waited least,
    which is the one that finished backward last, so its wait is transfer time left unhidden; the
    ranks' mean wait, which also counts the earlier rank waiting for its peer to finish backward."""
    def median(key: str, over: Callable[[tuple[float, ...]], float]) -> float:
        return statistics.median(over(it) for it in zip(*(r[key] for r in ranks)))

    step, alone = median("steps", max), median("alone", statistics.mean)
    least, mean = median("waits", min), median("waits", statistics.mean)
    return (f"| {'on' if distributed else 'off'} | {'on' if overlap else 'off'} | {1e3 * step:.0f} "
            f"| {1e3 * least:.0f} ({100 * least / step:.1f}%) | {1e3 * mean:.0f} | {1e3 * alone:.0f} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = [build_config(args, distributed, overlap) for distributed, overlap in CASES]
    per_rank = run_on_ranks(WORLD_SIZE, _rank_cases, configs, args)
    m, first = configs[0].model, per_rank[0][0]
    print(f"gpt2: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, vocab {m.vocab}, "
          f"{first['numel'] / 1e6:.1f}M parameters in {first['buckets']} buckets of >= {args.bucket_size:,} elements; "
          f"seq {args.seq}, micro batch {args.micro_batch}, {args.microbatches} micro batches/step/rank, "
          f"{args.precision}; {WORLD_SIZE} gloo ranks x 1 thread; torch {torch.__version__}; "
          f"median of {args.iters} steps after {args.warmup} warmup")
    print("| distributed optimizer | overlap_grad_reduce | step ms "
          "| wait ms, last rank out of backward (share of step) | wait ms, mean of ranks | reduction alone ms |")
    print("|---|---|---|---|---|---|")
    for index, (distributed, overlap) in enumerate(CASES):
        print(row(distributed, overlap, [timings[index] for timings in per_rank]))


if __name__ == "__main__":
    main()
