"""Pipeline bubble of megalite's schedules, measured against Megatron-LM's theory.

Every pipeline rank runs the real executor (`run_schedule`) with real gloo point-to-point
messages, but each model chunk's compute is a fixed sleep: forward t_f / vp, backward
t_b / vp, so a rank's work per micro batch is t_f + t_b at any vp. Sleeping stages need no
CPU, so pp ranks on a 2-core machine time like pp devices: beyond the compute, a step holds
the schedule's idle time (its bubble) and the per-operation cost of the messages.

The bubble is relative to the step without pipeline idle, bubble = (step - ideal) / ideal,
which theory puts at (pp - 1) / (vp * m) for 1F1B and interleaved 1F1B, and (pp - 1) / m for
GPipe. It is given against two ideals: the nominal m * (t_f + t_b), and the same rank's
operations timed back to back without a pipeline, which also pay for sleeps that end late
and for autograd, so that only the pipeline's own costs remain. The table also gives each
rank's peak of stored activations (`Trace.peak_in_flight`) next to the bound that Megatron-LM's
warm-up counts give. On a busy machine, --realtime makes a sleeping rank wake on time.

    python tools/benchmark_pipeline.py --realtime
    python tools/benchmark_pipeline.py --pp 4 --vp 1 2 4 --microbatches 8 16 32 --t-f 10 --t-b 20
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.parallel.p2p import PipelineComm
from megalite.parallel.pipeline_layout import PipelineStage
from megalite.parallel.schedules import Trace, run_schedule
from megalite.parallel.topology import Topology

SHAPE = (8, 1, 16)  # [seq, micro batch, hidden] of the messages: small, so transfers cost little


class Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `forward_s` and whose backward sleeps `backward_s`: a stage
    with a known cost that leaves the cores free for the other ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()  # a new tensor: the executor frees a sent activation's storage

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    vp: int
    m: int

    def theory(self) -> float:
        """Megatron-LM's bubble relative to the ideal time: (pp - 1) / (vp * m)."""
        return (self.pp - 1) / (self.vp * self.m)

    def expected_peak(self, rank: int) -> int:
        """Stored activations the schedule should hold at most on `rank`: Megatron-LM's warm-up
        forwards + 1 (all of them for GPipe, and for interleaving when m == pp), written out here
        so that the executed schedule is checked against it rather than against itself."""
        total = self.m * self.vp
        if self.schedule == "gpipe" or (self.vp > 1 and self.m == self.pp):
            return total
        if self.vp == 1:
            return min(self.pp - rank, total)
        return min((self.pp - rank - 1) * 2 + (self.vp - 1) * self.pp + 1, total)


def build_cases(args: argparse.Namespace, pp: int) -> list[Case]:
    """1F1B for every vp (interleaving needs m % pp == 0), and GPipe (one chunk per rank)."""
    cases = [Case("1f1b", pp, vp, m) for vp in args.vp for m in args.microbatches if vp == 1 or m % pp == 0]
    return cases + ([] if args.no_gpipe else [Case("gpipe", pp, 1, m) for m in args.microbatches])


def chunk_step(x: torch.Tensor, case: Case, args: argparse.Namespace) -> torch.Tensor:
    """One model chunk: t_f / vp forward and t_b / vp backward."""
    return Sleep.apply(x, args.t_f / 1e3 / case.vp, args.t_b / 1e3 / case.vp)


def no_pipeline_step(case: Case, args: argparse.Namespace) -> float:
    """Seconds for this rank's operations run back to back without a pipeline: the ideal step
    with the per-operation overheads (late wake-ups from sleep, autograd) that the pipeline pays too."""
    start = time.perf_counter()
    for _ in range(case.m * case.vp):
        chunk_step(torch.zeros(SHAPE, requires_grad=True), case, args).sum().backward()
    return time.perf_counter() - start


def late_recv_latency(rank: int, rounds: int = 10) -> float:
    """Median seconds (on rank 1) from posting a receive to its completion, the message sent 5 ms
    before: gloo holds a send until its receive is posted, and the executor posts a receive when
    the operation that needs it starts, so each message costs a round trip of this length."""
    buffer, times = torch.zeros(SHAPE), []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            dist.isend(buffer, 1).wait()
        elif rank == 1:
            time.sleep(0.005)
            start = time.perf_counter()
            dist.irecv(buffer, 0).wait()
            times.append(time.perf_counter() - start)
    return statistics.median(times) if times else 0.0


def time_case(case: Case, comm: PipelineComm, rank: int, args: argparse.Namespace) -> dict:
    """This rank's step times and times without a pipeline (seconds, one per timed step, each
    after a barrier), its peak of stored activations and the late-receive latency."""
    stage = PipelineStage(case.pp, case.vp, rank)

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        x = torch.zeros(SHAPE, requires_grad=True) if hidden is None else hidden  # so the first chunk's backward runs
        out = chunk_step(x, case, args)
        return out.sum() if stage.is_last_chunk(chunk) else out

    latency, steps, no_pipeline, trace = late_recv_latency(rank), [], [], Trace()
    for i in range(args.warmup + args.iters):
        dist.barrier()
        start = time.perf_counter()
        run_schedule(case.schedule, case.m, forward_step, stage, comm, trace)
        step = time.perf_counter() - start
        dist.barrier()
        if i >= args.warmup:
            steps.append(step)
            no_pipeline.append(no_pipeline_step(case, args))
    return {"steps": steps, "no_pipeline": no_pipeline, "latency": latency, "peak": trace.peak_in_flight}


def _worker(rank: int, pp: int, port: int, cases: list[Case], args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    if args.realtime:  # after the imports, and before gloo starts its threads, which inherit it
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except PermissionError as err:
            raise PermissionError("--realtime needs root or CAP_SYS_NICE; run without it") from err
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    try:
        comm = PipelineComm(Topology(rank, pp, torch.device("cpu"), pp=pp), SHAPE, torch.float32)
        for case in cases:
            gathered = [None] * pp
            dist.all_gather_object(gathered, time_case(case, comm, rank, args))
            if rank == 0:
                results.put((case, gathered))
    finally:
        dist.destroy_process_group()


def run_cases(pp: int, cases: list[Case], args: argparse.Namespace) -> list[tuple[Case, list]]:
    """Spawn pp gloo ranks once and run every case on them; returns each case's per-rank results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(pp, port, cases, args, results), nprocs=pp, join=True)
    return [results.get() for _ in cases]


def row(case: Case, ranks: list[dict], args: argparse.Namespace) -> str:
    """One table row. A step, pipelined or not, lasts until its slowest rank finishes; medians are
    over steps."""
    step, no_pipeline = (statistics.median(map(max, zip(*(r[key] for r in ranks)))) for key in ("steps", "no_pipeline"))
    ideal = case.m * (args.t_f + args.t_b) / 1e3
    theory = case.theory()
    bubble, bubble_np = (step - ideal) / ideal, (step - no_pipeline) / no_pipeline
    peaks = ",".join(str(r["peak"]) for r in ranks)
    expected = ",".join(str(case.expected_peak(rank)) for rank in range(case.pp))
    return (f"| {case.schedule} | {case.pp} | {case.vp} | {case.m} | {1e3 * step:.0f} | {1e3 * ideal:.0f} "
            f"| {1e3 * no_pipeline:.0f} | {theory:.3f} | {bubble:.3f} ({bubble / theory:.2f}x) "
            f"| {bubble_np:.3f} ({bubble_np / theory:.2f}x) "
            f"| {1e3 * ranks[1]['latency']:.2f} | {peaks} ({expected}) |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline ranks (one process each)")
    p.add_argument("--vp", type=int, nargs="+", default=[1, 2], help="virtual chunks per rank (1F1B only)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--t-f", type=float, default=20.0, help="forward ms per micro batch per rank (all its chunks)")
    p.add_argument("--t-b", type=float, default=40.0, help="backward ms per micro batch per rank (all its chunks)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--no-gpipe", action="store_true", help="skip the GPipe rows")
    p.add_argument("--realtime", action="store_true", help="ranks at SCHED_FIFO priority 1 (root or CAP_SYS_NICE), so "
                   "that other processes do not delay their wake-ups; they sleep, so they take little CPU")
    args = p.parse_args(argv)
    if min(args.pp) < 2:
        p.error(f"--pp {min(args.pp)}: a pipeline needs at least 2 ranks")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"t_f {args.t_f:g} ms, t_b {args.t_b:g} ms per micro batch per rank; messages {list(SHAPE)} fp32 over gloo; "
          f"torch {torch.__version__}; median of {args.iters} steps after {args.warmup} warmup"
          f"{'; ranks at SCHED_FIFO 1' if args.realtime else ''}")
    print("| schedule | pp | vp | m | step ms | ideal ms | no-pipeline ms | bubble theory | bubble vs ideal (x theory) "
          "| bubble vs no-pipeline (x theory) | late recv ms | peak stored per rank (expected) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pp in args.pp:
        for case, ranks in run_cases(pp, build_cases(args, pp), args):
            print(row(case, ranks, args), flush=True)


if __name__ == "__main__":
    main()
