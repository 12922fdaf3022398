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
   Each case runs on two clocks (`--clock`). "host": an operation's sleep holds the host thread from when the
   host reaches it to its end, so the host's time between operations (posting exchanges, autograd) adds to the
   step, as on a CPU rank. "device": an emulated device's timeline (DeviceClock): an operation starts when the
   device is done with the previous one, its input landed (at its sender's post) and the host launched it; the
   host sleeps only until it starts, so it posts the next exchanges while the device "computes", as a GPU's host
   does (one operation ahead; a GPU's host runs further). The host's time counts there only where the host
   falls behind its device; a transfer takes no device time in either clock (small messages).
3. Memory: the benchmark model itself trains one step per schedule on pp gloo ranks; each rank's activation
   memory at the schedule's peak (what autograd saves, plus what B leaves for W: planning/measure_pipeline.py)
   next to the planner's (planning/memory.py peak_activations).

    python tools/benchmark_pipeline.py --realtime
    python tools/benchmark_pipeline.py --realtime --pp 4 --microbatches 8 16 \
        --schedules 1f1b:1 1f1b:2 zb-h1:1 zb-v:2 dualpipev:2
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.parallel.p2p import Exchange, Message, PipelineComm
from megalite.parallel.pipeline.executor import PeakInFlight, run_schedule
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


def sleep_until(moment: float) -> None:
    """Sleep until `moment` on the host clock (time.perf_counter: CLOCK_MONOTONIC, one for every process of the
    machine, so ranks' moments compare)."""
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class HostClock:
    """Compute in series with the host, as the tool first slept it: an operation sleeps from when the host reaches
    it to its end, so all the host does between operations (posting exchanges, autograd) is on the critical path.
    What a CPU rank pays; not what a GPU's host costs, which queues work and goes on."""

    stamps = False  # messages carry no device time

    def restart(self) -> None:
        """A step starts now."""

    def run(self, seconds: float) -> None:
        """Compute for `seconds`."""
        time.sleep(seconds)

    def synchronize(self) -> None:
        """Wait for the compute queued so far (here: done)."""


@dataclass
class DeviceClock:
    """The timeline of an emulated device beside its host, as a GPU's stream runs beside the host thread that
    queues it: an operation starts when the device finished what was queued before it and when the host launched
    it, whichever is last, and lasts its time. The host sleeps until the operation starts, not until it ends, then
    goes on (posting the next exchanges, reaching the next operation) while the device "computes": one operation
    ahead, where a GPU's host runs further ahead (so this charges more, never less, of the host's time than a GPU
    would). Messages travel as NCCL's do: a send runs after the compute queued before its post, so a message lands
    at its sender's device time at the post (carried in its first 8 bytes: `stamp`); a wait on an exchange makes
    the device wait for what it received (`landed`), as `work.wait()` orders NCCL's compute stream. A receive
    runs after the compute queued before the receiver's post, which the receiver's timeline already orders. So
    a transfer costs no device time (these are [8, 1, 16] messages), gloo's real latency counts only where it
    delays a host past its device, and the host's time counts only where the host falls behind its device.
    `now` and `sleep` are the host's, replaced by a test's."""

    now: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = sleep_until
    free: float = 0.0  # when the device finishes what was queued so far
    stamps = True

    def restart(self) -> None:
        self.free = self.now()

    def run(self, seconds: float) -> None:
        """Queue `seconds` of compute; the host sleeps until it starts. No time is no operation (the W of a schedule
        that does not split the backward): nothing to queue; sleeping until it "starts" would hold the host until
        the device is idle."""
        if not seconds:
            return
        start = max(self.free, self.now())
        self.free = start + seconds
        self.sleep(start)

    def landed(self, moment: float) -> None:
        """The device waits for a message that lands at `moment` before what is queued next."""
        self.free = max(self.free, moment)

    def posted(self) -> float:
        """The device time after which an exchange posted now runs: after the compute queued so far, or now if
        the host is behind."""
        return max(self.free, self.now())

    def synchronize(self) -> None:
        self.sleep(self.free)


def stamp(tensor: torch.Tensor, moment: float) -> None:
    """Write `moment` (a device time) into the first 8 bytes of a message (fp32, contiguous, as sent)."""
    tensor.detach().view(-1)[:2].view(torch.float64).fill_(moment)


def stamp_of(tensor: torch.Tensor) -> float:
    """The device time a message landed: what `stamp` wrote."""
    return float(tensor.detach().reshape(-1)[:2].view(torch.float64))


@dataclass
class LandingExchange(Exchange):
    """An exchange whose wait makes its rank's device wait for what it received."""

    clock: DeviceClock = field(default_factory=DeviceClock)

    def wait(self) -> None:
        super().wait()
        for buffer in self.received.values():
            self.clock.landed(stamp_of(buffer))


@dataclass
class StampingComm(PipelineComm):
    """PipelineComm whose sends carry the device time of their post and whose waits order the device after what
    they received (DeviceClock)."""

    clock: DeviceClock = field(default_factory=DeviceClock)

    def exchange(self, messages: list[Message], outbox: dict[Message, torch.Tensor]) -> Exchange:
        posted = self.clock.posted()
        for message in messages:
            if message in outbox:
                stamp(outbox[message], posted)
        posting = super().exchange(messages, outbox)
        return LandingExchange(posting.works, posting.sent, posting.received, self.clock)


class Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `forward_s`, whose backward sleeps `backward_s` and hands a weight gradient
    that sleeps `weight_s` to weight_grads (at once, or in W under a zero-bubble schedule), on `clock`: a stage with
    known costs that leaves the cores free for the other ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, times: tuple[float, float, float],
                clock: HostClock | DeviceClock) -> torch.Tensor:
        clock.run(times[0])
        ctx.times, ctx.anchor, ctx.clock = times, anchor, clock
        return x.clone()  # a new tensor: the executor frees a sent activation's storage

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.clock.run(ctx.times[1])
        deliver(ctx.anchor, functools.partial(_weight_gradient, ctx.clock, ctx.times[2]))
        return grad, None, None, None


def _weight_gradient(clock: HostClock | DeviceClock, seconds: float) -> None:
    """A W that computes for `seconds` and deposits nothing."""
    clock.run(seconds)


CLOCKS = {"host": HostClock, "device": DeviceClock}


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    vp: int
    m: int
    clock: str = "host"

    @property
    def name(self) -> str:
        return schedule_spec(self.schedule).label(self.vp)


def chunk_times(case: Case, times: tuple[float, float, float]) -> tuple[float, float, float]:
    """Seconds one chunk sleeps: a rank's forward, B and W times over its vp chunks; B and W together when the
    schedule does not split them."""
    t_f, t_b, t_w = (t / 1e3 / case.vp for t in times)
    return (t_f, t_b, t_w) if schedule_spec(case.schedule).split_backward else (t_f, t_b + t_w, 0.0)


def no_pipeline_step(case: Case, times: tuple[float, float, float]) -> float:
    """Seconds for this rank's operations run back to back without a pipeline, on the case's clock."""
    clock, anchor = CLOCKS[case.clock](), torch.zeros(())
    start = time.perf_counter()
    clock.restart()
    for _ in range(case.m * case.vp):
        x = torch.zeros(SHAPE, requires_grad=True)
        Sleep.apply(x, anchor, chunk_times(case, times), clock).sum().backward()
    clock.synchronize()
    return time.perf_counter() - start


def time_case(rank: int, world_size: int, case: Case, times: tuple[float, float, float], iters: int,
              realtime: bool) -> dict:
    """This rank's step times and times without a pipeline (one per timed step, each after a barrier) and its
    peak of micro batches in flight."""
    if realtime:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    stage = schedule_spec(case.schedule).stage(case.pp, case.vp, rank)
    topology, clock = Topology(rank, world_size, torch.device("cpu"), pp=case.pp), CLOCKS[case.clock]()
    comm = (StampingComm(topology, SHAPE, torch.float32, clock) if clock.stamps
            else PipelineComm(topology, SHAPE, torch.float32))
    anchors = [torch.zeros(()) for _ in range(case.vp)]

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        x = torch.zeros(SHAPE, requires_grad=True) if hidden is None else hidden
        out = Sleep.apply(x, anchors[chunk], chunk_times(case, times), clock)
        return out.sum() if stage.is_last_chunk(chunk) else out

    steps, no_pipeline, trace = [], [], PeakInFlight()  # a trace's marks would add host time to the step
    for i in range(iters + 1):
        dist.barrier()
        start = time.perf_counter()
        clock.restart()
        run_schedule(case.schedule, case.m, forward_step, stage, comm, [trace])
        clock.synchronize()
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
    return (f"| {case.name} | {case.clock} | {case.vp} | {case.m} | {1e3 * step:.0f} | {1e3 * ideal:.0f} "
            f"| {1e3 * no_pipeline:.0f} | {formula:.3f} | {lists:.3f} | {exchanged:.3f} "
            f"| {bubble:.3f} ({bubble / formula:.2f}x) | {bubble_np:.3f} ({bubble_np / formula:.2f}x) | {peaks} |")


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
    p.add_argument("--clock", nargs="+", choices=list(CLOCKS), default=["device", "host"], help="how a sleeping "
                   "rank charges compute: device (an emulated device's timeline, the host one operation ahead, as "
                   "a GPU's host queues its stream: DeviceClock) or host (the host sleeps through each operation, "
                   "so its time between operations adds to the step: HostClock); each case runs on each clock")
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
    print("| schedule | clock | vp | m | step ms | ideal ms | no-pipeline ms | formula | op lists | plan's exchanges "
          "| bubble vs ideal (x formula) | bubble vs no-pipeline (x formula) | in flight per rank |\n"
          + "|---" * 13 + "|")
    for case in (Case(c.schedule, c.pp, c.vp, c.m, clock) for c in cases for clock in args.clock):
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
