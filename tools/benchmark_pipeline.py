"""Pipeline schedules measured: the bubble against each schedule's formula, activation memory against the planner.

1. Stage times: one middle pipeline stage of the benchmark model (--layers layers over --pp ranks) runs its
   forward, its B (input gradients) and its W (weight gradients) on one CPU thread, built as a zero-bubble
   schedule builds it (planning/measure_pipeline.py stage_times): T_F, T_B, T_W, medians.
2. Bubble: every pipeline rank runs the real executor (`run_schedule`) with real gloo messages, but each chunk's
   compute is a sleep: forward t_f / vp, B t_b / vp, W t_w / vp, in the measured ratios with t_f = --t-f ms (a
   schedule without W sleeps B and W together in its backward). Sleeping ranks need no CPU, so pp ranks on 2
   cores time like pp devices. Bubble = (step - ideal) / ideal, with ideal m (t_f + t_b + t_w), next to the
   schedule's formula with the same times (its ScheduleSpec's bubble; a paired F&B of DualPipeV sleeps its
   forward and its whole backward, F&B = F + B), to its op lists played out with free messages and with the
   communication plan's exchanges (planning/bubble.py); also against the same rank's operations run back to
   back without a pipeline, which pay the same late wake-ups and autograd, so that only the pipeline's costs
   remain. `--ratios` sleeps given ratios instead of measuring the stage, so that repeated runs compare alike.
3. Memory: the benchmark model itself trains one step per schedule on pp gloo ranks; each rank's activation
   memory at the schedule's peak (what autograd saves, plus what B leaves for W: planning/measure_pipeline.py)
   next to the planner's (planning/memory.py peak_activations).

    python tools/benchmark_pipeline.py --realtime
    python tools/benchmark_pipeline.py --realtime --pp 4 --microbatches 8 16 \
        --schedules 1f1b:1 1f1b:2 zb-h1:1 zb-v:2 dualpipev:2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.parallel.p2p import PipelineComm
from megalite.parallel.pipeline.executor import Trace, run_schedule
from megalite.parallel.pipeline.registry import SCHEDULES, schedule_spec, training_schedules
from megalite.parallel.spawn import run_on_ranks
from megalite.parallel.topology import Topology
from megalite.parallel.weight_grads import deliver
from megalite.planning.bubble import simulated_bubble
from megalite.planning.measure import measurement_config, mock_batches
from megalite.planning.measure_pipeline import activation_peak, stage_times
from megalite.planning.memory import peak_activations
from megalite.training.build import build_trainer
from megalite.training.step import train_step

SHAPE = (8, 1, 16)  # [seq, micro batch, hidden] of the sleeping stages' messages: small, so transfers cost little


class Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `forward_s`, whose backward sleeps `backward_s` and hands a weight gradient
    that sleeps `weight_s` to weight_grads (at once, or in W under a zero-bubble schedule): a stage with known
    costs that leaves the cores free for the other ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, times: tuple[float, float, float]) -> torch.Tensor:
        time.sleep(times[0])
        ctx.times, ctx.anchor = times, anchor
        return x.clone()  # a new tensor: the executor frees a sent activation's storage

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.times[1])
        deliver(ctx.anchor, lambda: time.sleep(ctx.times[2]))
        return grad, None, None


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    vp: int
    m: int

    @property
    def name(self) -> str:
        return schedule_spec(self.schedule).label(self.vp)


def chunk_times(case: Case, times: tuple[float, float, float]) -> tuple[float, float, float]:
    """Seconds one chunk sleeps: a rank's forward, B and W times over its vp chunks; B and W together when the
    schedule does not split them."""
    t_f, t_b, t_w = (t / 1e3 / case.vp for t in times)
    return (t_f, t_b, t_w) if schedule_spec(case.schedule).split_backward else (t_f, t_b + t_w, 0.0)


def no_pipeline_step(case: Case, times: tuple[float, float, float]) -> float:
    """Seconds for this rank's operations run back to back without a pipeline."""
    start, anchor = time.perf_counter(), torch.zeros(())
    for _ in range(case.m * case.vp):
        Sleep.apply(torch.zeros(SHAPE, requires_grad=True), anchor, chunk_times(case, times)).sum().backward()
    return time.perf_counter() - start


def time_case(rank: int, world_size: int, case: Case, times: tuple[float, float, float], iters: int,
              realtime: bool) -> dict:
    """This rank's step times and times without a pipeline (one per timed step, each after a barrier) and its
    peak of micro batches in flight."""
    if realtime:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    stage = schedule_spec(case.schedule).stage(case.pp, case.vp, rank)
    comm = PipelineComm(Topology(rank, world_size, torch.device("cpu"), pp=case.pp), SHAPE, torch.float32)
    anchors = [torch.zeros(()) for _ in range(case.vp)]

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        x = torch.zeros(SHAPE, requires_grad=True) if hidden is None else hidden
        out = Sleep.apply(x, anchors[chunk], chunk_times(case, times))
        return out.sum() if stage.is_last_chunk(chunk) else out

    steps, no_pipeline, trace = [], [], Trace()
    for i in range(iters + 1):
        dist.barrier()
        start = time.perf_counter()
        run_schedule(case.schedule, case.m, forward_step, stage, comm, [trace])
        step = time.perf_counter() - start
        dist.barrier()
        if i:
            steps.append(step)
            no_pipeline.append(no_pipeline_step(case, times))
    return {"steps": steps, "no_pipeline": no_pipeline, "peak": trace.peak_in_flight}


def bubble_row(case: Case, ranks: list[dict], times: tuple[float, float, float]) -> str:
    """A step lasts until its slowest rank finishes; medians over steps."""
    step, no_pipeline = (statistics.median(map(max, zip(*(r[key] for r in ranks)))) for key in ("steps", "no_pipeline"))
    ideal = case.m * sum(times) / 1e3
    formula = schedule_spec(case.schedule).bubble(case.pp, case.vp, case.m, *times)
    lists = simulated_bubble(case.schedule, case.pp, case.vp, case.m, *times)
    exchanged = simulated_bubble(case.schedule, case.pp, case.vp, case.m, *times, exchanges=True)
    bubble, bubble_np = (step - ideal) / ideal, (step - no_pipeline) / no_pipeline
    peaks = ",".join(str(r["peak"]) for r in ranks)
    return (f"| {case.name} | {case.vp} | {case.m} | {1e3 * step:.0f} | {1e3 * ideal:.0f} | {1e3 * no_pipeline:.0f} "
            f"| {formula:.3f} | {lists:.3f} | {exchanged:.3f} | {bubble:.3f} ({bubble / formula:.2f}x) "
            f"| {bubble_np:.3f} ({bubble_np / formula:.2f}x) | {peaks} |")


def model_config(args: argparse.Namespace, case: Case):
    """The benchmark model under `case`'s schedule: a llama of --layers layers, one step of m micro batches."""
    model = {"family": "llama", "num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": 4,
             "num_query_groups": 2, "seq_length": args.seq, "vocab_size": args.vocab}
    return measurement_config(case.pp, model=model, parallel={"pp": case.pp, "vp": case.vp,
                                                              "pipeline_schedule": case.schedule},
                              train={"micro_batch_size": args.micro_batch_size,
                                     "global_batch_size": case.m * args.micro_batch_size})


def memory_case(rank: int, world_size: int, args: argparse.Namespace, case: Case) -> tuple[int, int]:
    """(measured, planned) activation bytes at the schedule's peak on this rank, one real training step."""
    cfg = model_config(args, case)
    topology = Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel)
    with build_trainer(cfg, topology) as trainer:
        batches = mock_batches(cfg, case.m)
        measured = activation_peak(trainer, lambda: train_step(trainer, batches))
    return measured, peak_activations(cfg, world_size, topology.pp_rank, "cpu")[0]


def memory_row(case: Case, ranks: list[tuple[int, int]]) -> str:
    cells = " | ".join(f"{got / 2**20:.2f} ({planned / 2**20:.2f}, {got / planned - 1:+.1%})" for got, planned in ranks)
    return f"| {case.name} | {case.vp} | {case.m} | {cells} |"


def cpu_line() -> str:
    """`lscpu`'s model name and whether the CPU has avx512_bf16 (bf16 matmuls in hardware)."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    return f"{model}, {os.cpu_count()} cores, avx512_bf16: {'yes' if 'avx512_bf16' in text else 'no'}"


def _every_schedule() -> list[str]:
    """SCHEDULE:VP for every registered training schedule at each vp of 1 and 2 it runs at."""
    return [f"{name}:{vp}" for name in training_schedules() for vp in (1, 2) if SCHEDULES[name].vp in (None, vp)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (one process each)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--schedules", nargs="+", default=_every_schedule(), help="SCHEDULE:VP pairs (default: every "
                   "training schedule at vp 1 and 2, or at the vp it needs)")
    p.add_argument("--t-f", type=float, default=20.0, help="a stage's sleeping forward, ms (B and W in the ratios "
                                                           "measured)")
    p.add_argument("--ratios", type=float, nargs=2, metavar=("B/F", "W/F"), help="the sleeping B and W as ratios of "
                   "t_f, instead of measuring the stage (so that repeated runs sleep the same times)")
    p.add_argument("--layers", type=int, default=16, help="benchmark model layers (a stage holds layers / pp)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed steps per case (after one untimed)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--realtime", action="store_true", help="ranks at SCHED_FIFO priority 1 (root or CAP_SYS_NICE), so "
                   "that other processes do not delay their wake-ups; they sleep, so they take little CPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [Case(name, args.pp, int(vp), m) for m in args.microbatches
             for name, vp in (pair.split(":") for pair in args.schedules)]
    torch.set_num_threads(1)
    print(f"CPU: {cpu_line()}; Python {platform.python_version()}, torch {torch.__version__}; load average "
          f"{' '.join(f'{load:.1f}' for load in os.getloadavg())}")
    if args.ratios:
        times = (args.t_f, args.t_f * args.ratios[0], args.t_f * args.ratios[1])
    else:
        t_f, t_b, t_w = stage_times(model_config(args, Case(ParallelConfig().pipeline_schedule, args.pp, 1, args.pp)),
                                    1)
        times = (args.t_f, args.t_f * t_b / t_f, args.t_f * t_w / t_f)
        print(f"stage times (stage 1 of {args.pp}: {args.layers // args.pp} layers, hidden {args.hidden}, seq "
              f"{args.seq}, micro batch {args.micro_batch_size}, fp32, 1 thread): T_F {1e3 * t_f:.2f} ms, T_B "
              f"{1e3 * t_b:.2f} ms, T_W {1e3 * t_w:.2f} ms; T_B/T_F {t_b / t_f:.2f}, T_W/T_F {t_w / t_f:.2f}")
    print(f"sleeping stages: t_f {times[0]:.1f}, t_b {times[1]:.1f}, t_w {times[2]:.1f} ms per micro batch per rank; "
          f"median of {args.iters} steps{'; ranks at SCHED_FIFO 1' if args.realtime else ''}")
    print("| schedule | vp | m | step ms | ideal ms | no-pipeline ms | formula | op lists | plan's exchanges "
          "| bubble vs ideal (x formula) | bubble vs no-pipeline (x formula) | in flight per rank |\n"
          + "|---" * 12 + "|")
    for case in cases:
        print(bubble_row(case, run_on_ranks(case.pp, time_case, case, times, args.iters, args.realtime), times),
              flush=True)
    if args.no_memory:
        return
    print("\nactivation memory at the schedule's peak per rank, MiB measured (planner, difference)")
    print(f"| schedule | vp | m | {' | '.join(f'rank {r}' for r in range(args.pp))} |\n|---|---|---|"
          + "---|" * args.pp)
    for case in cases:
        print(memory_row(case, run_on_ranks(case.pp, memory_case, args, case)), flush=True)


if __name__ == "__main__":
    main()
