"""The pipeline bubble of a schedule: its formula (its ScheduleSpec, parallel/pipeline/) and its op lists played
out with given operation times.

`simulated_step` runs every rank's list as the executor would with free, instant messages: an operation starts
when its rank is free and its inputs exist (the previous chunk's forward, the next chunk's backward, its own
B for a W; both parts' for a paired F&B, which takes its own time). What the lists alone cost, before any
communication: tests hold the formulas to it, the planner shows it beside the formula (planning/plan.py), and
the pipeline benchmark (tools/benchmark_pipeline.py) compares measured steps with both.

With `exchanges=True` the messages travel as the executor sends them: in the communication plan's exchanges,
each one batched call with one neighbour that a rank posts before its next operation, complete only when every
message in it was posted on both sides (NCCL progresses a batch's calls together; the executor waits on the
whole batch). When an exchange held a whole round, with both neighbours, a rank waiting for its input from one
waited for the other too: the zero-bubble orders lost 0.05-0.13 of their step to that (docs/benchmarks.md);
with one neighbour per exchange the lists idle as with free messages.
"""

from __future__ import annotations

from megalite.parallel.p2p import Message
from megalite.parallel.pipeline.ops import FB, B, F, Op, W
from megalite.parallel.pipeline.plan import communication_plan, is_local, needs
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import PipelineStage


def _dependency(stage: PipelineStage, op: Op) -> tuple[str, int, int, int] | None:
    """(kind, rank, chunk, micro batch) of the operation `op` waits for, or None."""
    kind, chunk, mb = op
    g = stage.global_chunk(chunk)
    if kind == F:
        return None if g == 0 else (F, *stage.holder(g - 1), mb)
    if kind == B:
        return (F, stage.rank, chunk, mb) if g == stage.model_chunks - 1 else (B, *stage.holder(g + 1), mb)
    return B, stage.rank, chunk, mb


class _Rounds:
    """When each rank posts each exchange of the communication plan, and when the exchange carrying a message
    completes on its receiver."""

    def __init__(self, spec: ScheduleSpec, pp: int, vp: int, microbatches: int) -> None:
        self.plans = communication_plan(spec, pp, vp, microbatches)
        self.posted: dict[tuple[int, Message], float] = {}
        self.carrier: dict[tuple[int, Message], list[Message]] = {}

    def post(self, rank: int, index: int, clock: float) -> None:
        for exchange in self.plans[rank][index]:
            for message in exchange:
                self.posted.setdefault((rank, message), clock)
                self.carrier[(rank, message)] = exchange

    def arrival(self, rank: int, message: Message) -> float | None:
        """When the exchange carrying `message` to `rank` completes; None while a side has not posted it yet."""
        times = [self.posted.get((side, m)) for m in self.carrier[(rank, message)] for side in (m.src, m.dst)]
        return None if None in times else max(times)


def simulated_step(schedule: str | ScheduleSpec, pp: int, vp: int, microbatches: int, t_f: float = 1.0,
                   t_b: float = 1.0, t_w: float = 1.0, exchanges: bool = False, t_fb: float | None = None) -> float:
    """The step time of `schedule` with a rank's forward, input-gradient and weight-gradient times t_f, t_b,
    t_w and a paired forward and whole backward's t_fb (None: t_f + t_b + t_w; each its whole stage: each chunk
    takes 1/vp of them); a B without a W in its rank's list runs B and W as one backward. `exchanges`:
    messages in the plan's exchanges (module docstring), else free and instant."""
    spec = schedule_spec(schedule)
    stages = [spec.stage(pp, vp, r) for r in range(pp)]
    ops = [spec.rank_ops(pp, vp, r, microbatches) for r in range(pp)]
    took = {F: t_f / vp, W: t_w / vp, FB: (t_f + t_b + t_w if t_fb is None else t_fb) / vp}
    done: dict[tuple[str, int, int, int], float] = {}
    rounds = _Rounds(spec, pp, vp, microbatches) if exchanges and pp > 1 else None
    position, clock = [0] * pp, [0.0] * pp
    deferring = [{(op.chunk, op.microbatch) for op in rank_ops if op.kind == W} for rank_ops in ops]
    progress = True
    while progress:
        progress = False
        for r, stage in enumerate(stages):
            while position[r] < len(ops[r]):
                op = ops[r][position[r]]
                if rounds is not None:
                    rounds.post(r, position[r], clock[r])
                ready = [_ready(stage, part, done, rounds) for part in op.parts]
                if None in ready:
                    break
                whole = op.kind == B and (op.chunk, op.microbatch) not in deferring[r]
                clock[r] = max(clock[r], *ready) + took.get(op.kind, (t_b + whole * t_w) / vp)
                for part in op.parts:
                    done[(part.kind, r, part.chunk, part.microbatch)] = clock[r]
                position[r], progress = position[r] + 1, True
            if rounds is not None and position[r] == len(ops[r]):
                rounds.post(r, position[r], clock[r])  # the exchanges after its last operation
    if position != [len(o) for o in ops]:
        raise RuntimeError(f"schedule {spec.name} (pp={pp}, vp={vp}, {microbatches} micro batches) cannot finish")
    return max(clock)


def _ready(stage: PipelineStage, op: Op, done: dict[tuple[str, int, int, int], float],
           rounds: _Rounds | None) -> float | None:
    """When `op`'s input is there (its dependency done and, with exchanges, its exchange complete); None: not
    yet."""
    needed = _dependency(stage, op)
    if needed is not None and needed not in done:
        return None
    ready = done[needed] if needed else 0.0
    message = needs(stage, op)
    if rounds is None or message is None or is_local(message):
        return ready
    arrival = rounds.arrival(stage.rank, message)
    return None if arrival is None else max(ready, arrival)


def simulated_bubble(schedule: str | ScheduleSpec, pp: int, vp: int, microbatches: int, t_f: float = 1.0,
                     t_b: float = 1.0, t_w: float = 1.0, exchanges: bool = False, t_fb: float | None = None) -> float:
    """`simulated_step`'s idle share of the ideal step m (t_f + t_b + t_w), as `bubble_fraction` gives it."""
    ideal = microbatches * (t_f + t_b + t_w)
    return simulated_step(schedule, pp, vp, microbatches, t_f, t_b, t_w, exchanges, t_fb) / ideal - 1

