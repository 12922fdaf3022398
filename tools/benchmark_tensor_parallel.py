"""Forward+backward time of one transformer layer at tp=1 against tp=2, with and without
sequence parallelism, and how much of it is communication.

All configurations get the same cores: tp=1 runs on one rank with `--cores` intra-op threads
(the other rank waits, idle, in a barrier), tp=2 on two gloo ranks with `--cores / 2` threads
each. So the comparison is between splitting the matmuls across cores by threads and splitting
them across ranks by tensor parallelism, which also pays for its collectives. The
configurations take turns iteration by iteration, so that a shared machine's changing load
hits them alike.

To see the price of communication, a meter observes the collectives `megalite.parallel.mappings`
calls (the ranks' process groups are observed ones: megalite.parallel.observed). "In step" is the
wall time a rank spent inside them during fwd+bwd (posting each and waiting on it), waiting for
its peer included; "replayed" runs the same collectives again afterwards, each after a barrier:
the transfer cost alone.

Example (the defaults: a GPT-2 medium-sized layer, fp32):
    python tools/benchmark_tensor_parallel.py
    python tools/benchmark_tensor_parallel.py --family llama --hidden 2048 --heads 16 --seq 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megalite.config import Config, ModelConfig
from megalite.model.gpt import TransformerLayer
from megalite.model.rope import rope_for, rope_tables
from megalite.parallel.context import ParallelContext
from megalite.parallel.observed import CommObserver, GroupCall, observing
from megalite.parallel.spawn import run_on_ranks
from megalite.parallel.topology import Topology
from megalite.training.step import precision_context

CONFIGS = ("tp=1", "tp=2", "tp=2 + SP")
# Bytes one rank sends in a ring implementation, in units of (n-1)/n times the collective's full
# (unsplit) tensor, as nccl-tests' bus bandwidth counts them; keyed by the process group's operation.
_RING_PASSES = {"allreduce": 2, "all_gather_single": 1, "reduce_scatter_single": 1}


@dataclass
class CommMeter(CommObserver):
    """Wall time and ring bytes spent in collectives since the last reset(), and the calls
    themselves, so that they can be replayed without the compute in between. It observes the
    process groups (megalite.parallel.observed): the time inside posting each collective and
    inside each wait on it."""

    seconds: float = 0.0
    bytes_sent: float = 0.0
    calls: list[GroupCall] = field(default_factory=list)
    _since: float = 0.0

    def reset(self) -> None:
        self.seconds, self.bytes_sent, self.calls = 0.0, 0.0, []

    def posting(self, call: GroupCall) -> None:
        self._since = time.perf_counter()

    def posted(self, call: GroupCall) -> None:
        self._add(call, self._since)
        if call.operation in _RING_PASSES:
            self.calls.append(call)
            full = call.tensors()[1 if call.operation == "reduce_scatter_single" else 0]
            n = call.group.size()
            self.bytes_sent += full.nbytes * _RING_PASSES[call.operation] * (n - 1) / n

    def waiting(self, call: GroupCall) -> None:
        self._since = time.perf_counter()

    def waited(self, call: GroupCall) -> None:
        self._add(call, self._since)

    def _add(self, call: GroupCall, since: float) -> None:
        if call.operation in _RING_PASSES:
            self.seconds += time.perf_counter() - since


def replay_seconds(calls: list[GroupCall]) -> float:
    """One iteration's collectives again, each after a barrier, on copies (the originals may be autograd views)."""
    total = 0.0
    for call in calls:
        arguments = tuple(_copied(a) for a in call.arguments)
        dist.barrier()
        start = time.perf_counter()
        getattr(call.group, call.operation)(*arguments, **call.keywords).wait()
        total += time.perf_counter() - start
    return total


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return [_copied(v) for v in value] if isinstance(value, list) else value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 = autocast, as train.precision")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations before timing")
    p.add_argument("--cores", type=int, default=2, help="intra-op threads in total, split evenly over the ranks")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    m = Config().model
    m.family, m.hidden_size, m.num_attention_heads, m.seq_length = args.family, args.hidden, args.heads, args.seq
    m.num_layers = 1
    return m


@dataclass
class Case:
    """One configuration on this rank: its layer, input, output gradient and threads."""

    layer: TransformerLayer
    x: torch.Tensor
    grad: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    threads: int

    @classmethod
    def build(cls, tp: ParallelContext, threads: int, args: argparse.Namespace) -> Case:
        m, cpu = model_config(args), torch.device("cpu")
        layer = TransformerLayer(m, cpu, tp)
        generator = torch.Generator().manual_seed(args.seed)  # the same draws on every rank, as their shapes match
        with torch.no_grad():  # timing only: any finite weights (not torch.empty's garbage, which may hold denormals)
            for param in layer.parameters():
                param.normal_(0.0, m.init_std, generator=generator)
        x, grad = (torch.randn(args.seq, args.micro_batch, args.hidden, generator=generator) for _ in range(2))
        if tp.sequence_parallel:
            x, grad = x.chunk(tp.tp.size)[tp.tp.rank], grad.chunk(tp.tp.size)[tp.tp.rank]
        rope = (rope_for(rope_tables(m, cpu), args.seq, None)
                if m.features.position_embedding == "rope" else None)
        return cls(layer, x.clone().requires_grad_(), grad, rope, threads)

    def fwd_bwd_seconds(self, precision: str) -> float:
        torch.set_num_threads(self.threads)
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None
        start = time.perf_counter()
        with precision_context(precision, self.x.device):
            out = self.layer(self.x, self.rope)
        out.backward(self.grad.to(out.dtype))
        return time.perf_counter() - start


def time_cases(rank: int, args: argparse.Namespace) -> dict[str, dict]:
    """Time every configuration this rank takes part in, taking turns; returns per-configuration numbers."""
    meter = CommMeter()
    topology = Topology(rank, 2, torch.device("cpu"), tp=2)
    cases = {"tp=1": Case.build(ParallelContext(), args.cores, args)} if rank == 0 else {}
    for name, sp in (("tp=2", False), ("tp=2 + SP", True)):
        cases[name] = Case.build(ParallelContext.from_topology(topology, sp, args.seed), args.cores // 2, args)
    record: dict[str, dict] = {name: {"steps": [], "comms": []} for name in cases}
    calls: dict[str, list[GroupCall]] = {}
    for i in range(args.warmup + args.iters):
        for name in CONFIGS:
            dist.barrier()
            if name in cases:
                meter.reset()
                with observing(meter):
                    step = cases[name].fwd_bwd_seconds(args.precision)
                if i >= args.warmup:
                    record[name]["steps"].append(step)
                    record[name]["comms"].append(meter.seconds)
                    record[name]["bytes_sent"], calls[name] = meter.bytes_sent, meter.calls
    for name, entry in record.items():  # the same order on both ranks, so their collectives pair up
        if name != "tp=1" and not calls[name]:
            raise RuntimeError(f"{name}: no collective was timed; mappings.py calls one missing from _RING_PASSES")
        entry["calls"] = len(calls[name])
        entry["replayed"] = statistics.median(replay_seconds(calls[name]) for _ in range(args.iters))
    return record


def _rank_cases(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    return time_cases(rank, args)


def summarize(name: str, ranks: list[dict], threads: int) -> str:
    """One table row: medians over iterations of the slowest rank's step and of the ranks' mean
    communication time; the replayed time is the ranks' mean; bandwidths are per rank."""
    step = statistics.median(max(it) for it in zip(*(r["steps"] for r in ranks)))
    comm = statistics.median(statistics.mean(it) for it in zip(*(r["comms"] for r in ranks)))
    replayed = statistics.mean(r["replayed"] for r in ranks)
    sent = ranks[0]["bytes_sent"]
    rate = (lambda t: f"{sent / t / 1e9:.2f}") if sent else (lambda t: "-")
    return (f"| {name} | {len(ranks)} x {threads} | {1e3 * step:.0f} | {1e3 * comm:.0f} ({100 * comm / step:.0f}%) "
            f"| {1e3 * replayed:.0f} | {ranks[0]['calls']} | {sent / 2**20:.0f} | {rate(comm)} | {rate(replayed)} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cores % 2:
        raise SystemExit(f"--cores={args.cores} must be even, so that each tp=2 rank gets the same number of threads")
    m = model_config(args)
    print(f"{m.family} layer: hidden {m.hidden_size}, {m.num_attention_heads} heads, ffn {m.ffn_size}, seq {args.seq}, "
          f"micro batch {args.micro_batch}, {args.precision}, torch {torch.__version__}; "
          f"median of {args.iters} iterations after {args.warmup} warmup")
    ranks = run_on_ranks(2, _rank_cases, args, threads=None, observed_groups=True)
    print("| config | ranks x threads | fwd+bwd ms | comm ms in step (share) | comm ms replayed | collectives "
          "| MiB sent/rank | GB/s in step | GB/s replayed |\n|---|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        mine = [r[name] for r in ranks if name in r]
        print(summarize(name, mine, args.cores // len(mine)))


if __name__ == "__main__":
    main()
