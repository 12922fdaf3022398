"""The pipeline bubble of a schedule: its formula (registered with the schedule, parallel/schedules.py) and its
op lists played out with given operation times.

`simulated_step` runs every rank's list as the executor would with free, instant messages: an operation starts
when its rank is free and its input exists (the previous chunk's forward, the next chunk's backward, its own
B for a W). What the lists alone cost, before any communication: tests hold the formulas to it, and the
pipeline benchmark (tools/benchmark_pipeline.py) compares measured steps with both.

With `exchanges=True` the messages travel as the executor sends them: in the communication plan's rounds, each
round one batched exchange a rank posts before its next operation, complete only when every message in it was
posted on both sides (NCCL progresses a batch's calls together; the executor waits on the whole batch). A rank
that sends to one neighbour and receives from the other in one round cannot take its input before the other
neighbour posts: the lock-step plan's cost, which 1F1B does not pay and the zero-bubble orders do.
"""

from __future__ import annotations

from megalite.parallel.p2p import Message
from megalite.parallel.pipeline_layout import PipelineStage, placement_of
from megalite.parallel.schedules import B, F, Op, communication_plan, is_local, needs, schedule_ops, splits_backward


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

    def __init__(self, name: str, pp: int, vp: int, microbatches: int) -> None:
        self.plans = communication_plan(name, pp, vp, microbatches)
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


def simulated_step(name: str, pp: int, vp: int, microbatches: int, t_f: float = 1.0, t_b: float = 1.0,
                   t_w: float = 1.0, exchanges: bool = False) -> float:
    """The step time of schedule `name` with a rank's forward, input-gradient and weight-gradient times t_f, t_b,
    t_w (its whole stage: each chunk takes 1/vp of them); a schedule without W runs B and W as one backward.
    `exchanges`: messages in the plan's batched rounds (module docstring), else free and instant."""
    if not splits_backward(name):
        t_b, t_w = t_b + t_w, 0.0
    stages = [PipelineStage(pp, vp, r, placement=placement_of(name)) for r in range(pp)]
    ops = [schedule_ops(name, pp, vp, r, microbatches) for r in range(pp)]
    took = {F: t_f / vp, B: t_b / vp, "W": t_w / vp}
    done: dict[tuple[str, int, int, int], float] = {}
    rounds = _Rounds(name, pp, vp, microbatches) if exchanges and pp > 1 else None
    position, clock = [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r, stage in enumerate(stages):
            while position[r] < len(ops[r]):
                op = ops[r][position[r]]
                if rounds is not None:
                    rounds.post(r, position[r], clock[r])
                ready = _ready(stage, op, done, rounds)
                if ready is None:
                    break
                clock[r] = max(clock[r], ready) + took[op.kind]
                done[(op.kind, r, op.chunk, op.microbatch)] = clock[r]
                position[r], progress = position[r] + 1, True
            if rounds is not None and position[r] == len(ops[r]):
                rounds.post(r, position[r], clock[r])  # the rounds after its last operation
    if position != [len(o) for o in ops]:
        raise RuntimeError(f"schedule {name} (pp={pp}, vp={vp}, {microbatches} micro batches) cannot finish")
    return max(clock)


def _ready(stage: PipelineStage, op: Op, done: dict[tuple[str, int, int, int], float],
           rounds: _Rounds | None) -> float | None:
    """When `op`'s input is there (its dependency done and, with rounds, its exchange complete); None: not yet."""
    needed = _dependency(stage, op)
    if needed is not None and needed not in done:
        return None
    ready = done[needed] if needed else 0.0
    message = needs(stage, op)
    if rounds is None or message is None or is_local(message):
        return ready
    arrival = rounds.arrival(stage.rank, message)
    return None if arrival is None else max(ready, arrival)


def simulated_bubble(name: str, pp: int, vp: int, microbatches: int, t_f: float = 1.0, t_b: float = 1.0,
                     t_w: float = 1.0, exchanges: bool = False) -> float:
    """`simulated_step`'s idle share of the ideal step m (t_f + t_b + t_w), as `bubble_fraction` gives it."""
    ideal = microbatches * (t_f + t_b + t_w)
    return simulated_step(name, pp, vp, microbatches, t_f, t_b, t_w, exchanges) / ideal - 1

