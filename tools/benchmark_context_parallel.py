"""Activation memory per rank under context parallelism against the planner, and one step's
forward+backward time with ring attention (p2p) and all-gather attention, on CPU gloo ranks.

Each configuration spawns cp ranks (one intra-op thread each) that build the model the way training
does (build_trainer with a Topology of cp ranks) and run micro batches of random tokens, each rank
on its part of every sequence (local_positions: chunks i and 2cp-1-i).

Activation memory is what autograd keeps for backward during one forward (loss included): the
distinct storages its saved-tensor hooks see, parameters left out. That counts a view (v of the
fused QKV output, a slice of the gathered K/V) as the whole storage it keeps alive, and counts
nothing that forward frees on its way (communication buffers, the ring's block outputs). It is
what the planner's `activations` line predicts (planning/activations.py); the same measure
(planning/measure.py `saved_storages`) backs tests/test_plan.py. Allocator figures would add the
transient buffers and reuse, so they are not used.

Timing: the median over `--steps` of the slowest rank's forward+backward (a barrier before each),
after one warm-up step. No optimizer step and no gradient reduction: only the model and its
attention communication. Ranks share this machine's cores, so compare times within one cp only.

    python tools/benchmark_context_parallel.py
    python tools/benchmark_context_parallel.py --seq 4096 --cps 1 2 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megalite.config import Config
from megalite.parallel.context_parallel import local_positions
from megalite.parallel.spawn import run_on_ranks
from megalite.parallel.topology import Topology
from megalite.planning.context_parallel import comm_bytes
from megalite.planning.measure import measurement_config, model_fields, saved_bytes
from megalite.planning.memory import chunk_activation_bytes
from megalite.training.build import build_trainer

MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192, help="sequence length (divisible by 2 * every cp)")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes to run")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="KV groups (grouped-query attention)")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--steps", type=int, default=3, help="timed forward+backward steps after one warm-up")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace, cp: int, comm: str) -> Config:
    """A tiny Llama in fp32 without recompute; micro batch 1."""
    return measurement_config(
        cp, model={**model_fields(args), "family": "llama", "num_query_groups": args.groups},
        parallel={"cp": cp, "cp_comm": comm, "overlap_grad_reduce": False},
        train={"micro_batch_size": 1, "global_batch_size": 1, "precision": "fp32", "param_dtype": "fp32",
               "recompute": "none"})


def _rank(rank: int, world: int, cfg: Config, steps: int) -> tuple[int, list[float]]:
    """(activation bytes of one forward, seconds of each timed forward+backward) on this rank."""
    topology = Topology(rank, world, torch.device("cpu"), cp=world)
    model = build_trainer(cfg, topology).model.train()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab, (1, cfg.model.seq_length), generator=generator)
    positions = None
    if world > 1:
        local = local_positions(cfg.model.seq_length, world, rank)
        tokens, positions = tokens[:, local], local.expand(1, -1)
    forward = lambda: model(tokens, tokens, position_ids=positions).mean()  # noqa: E731
    saved = saved_bytes(model, forward)  # also the warm-up step
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        forward().backward()
        times.append(time.perf_counter() - start)
    return saved, times


def measure(args: argparse.Namespace, cp: int, comm: str) -> dict:
    cfg = make_config(args, cp, comm)
    ranks = run_on_ranks(cp, _rank, cfg, args.steps)
    slowest = [max(times) for times in zip(*(r[1] for r in ranks))]
    forward, backward = comm_bytes(cfg)
    return {"cp": cp, "comm": comm if cp > 1 else "-", "measured": max(r[0] for r in ranks),
            "planned": chunk_activation_bytes(cfg, 0, "cpu")[0], "seconds": statistics.median(slowest),
            "sent": f"{forward / MIB:.1f} / {backward / MIB:.1f}"}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"llama, {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.groups} KV), vocab "
          f"{args.vocab}, seq {args.seq}, micro batch 1, fp32, recompute none; torch {torch.__version__}, "
          f"1 thread per rank; median of {args.steps} steps")
    rows = [measure(args, cp, comm) for cp in args.cps for comm in (["p2p"] if cp == 1 else ["p2p", "allgather"])]
    print("| cp | comm | measured MiB per rank | planned MiB | measured / planned | fwd+bwd s "
          "| planned MiB sent per rank per layer, fwd / bwd |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['comm']} | {r['measured'] / MIB:.1f} | {r['planned'] / MIB:.1f} | "
              f"{r['measured'] / r['planned']:.3f} | {r['seconds']:.2f} | {r['sent']} |")


if __name__ == "__main__":
    main()
