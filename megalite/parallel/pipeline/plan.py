"""When each pipeline message travels: a communication plan NCCL cannot deadlock on.

A message goes to whoever holds the next (or previous) chunk (the stage's chunk order, stage.py), which under
a V order may be the sender itself, a hand-off that never touches the network. `communication_plan` decides
when each message travels. It plays all ranks' lists in lock step (a rank runs its next operation once its
inputs were produced at an earlier step) and, after each step, forms one round: every message produced in
that step, sent and received in that round. A round is split by the pair of ranks a message travels between:
each pair's messages are one exchange, one batched call on that pair's own communicator (p2p.py), which a
rank posts between the operations where its round falls (executor.py), so that a rank waiting for its
input from one neighbour never waits for the other. Every rank posts its exchanges in one global order,
(round, pair); sender and receiver post a message in the same exchange, and an exchange depends only on
exchanges before it in that order (an operation needs messages of earlier rounds). So the lowest unfinished
exchange can always finish, whether NCCL runs the pairs' communicators side by side or one after another:
no schedule can deadlock (the NCCL-rule replay test checks the real calls under both).
"""

from __future__ import annotations

import functools
import itertools

from megalite.parallel.p2p import Message
from megalite.parallel.pipeline.ops import B, F, Op
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import PipelineStage


def needs(stage: PipelineStage, op: Op) -> Message | None:
    """The message `op` consumes: an activation from the previous chunk's holder, a gradient from the next's."""
    kind, chunk, mb = op
    g = stage.global_chunk(chunk)
    if kind == F and g > 0:
        return Message(F, chunk, mb, stage.holder(g - 1)[0], stage.rank)
    if kind == B and g < stage.model_chunks - 1:
        return Message(B, chunk, mb, stage.holder(g + 1)[0], stage.rank)
    return None


def sends(stage: PipelineStage, op: Op) -> Message | None:
    """The message `op` produces, named by the chunk that consumes it on the receiving rank."""
    kind, chunk, mb = op
    g = stage.global_chunk(chunk)
    if kind == F and g < stage.model_chunks - 1:
        dst, consumer = stage.holder(g + 1)
        return Message(F, consumer, mb, stage.rank, dst)
    if kind == B and g > 0:
        dst, consumer = stage.holder(g - 1)
        return Message(B, consumer, mb, stage.rank, dst)
    return None


def is_local(message: Message) -> bool:
    """A hand-off between two chunks of one rank (ZB-V's turn at the last rank): no communication."""
    return message.src == message.dst


Plan = list[list[list[Message]]]  # per operation index (and one past the last): the exchanges to post before it


def communication_plan(schedule: str | ScheduleSpec, pp: int, vp: int, microbatches: int) -> dict[int, Plan]:
    """For every pipeline rank, the exchanges (one round's messages with one neighbour) to post before each of
    its operations, in (round, pair) order. A hand-off to the same rank is in no exchange: it is there for the
    rank's next operations."""
    return _plan(schedule_spec(schedule), pp, vp, microbatches)


@functools.lru_cache(maxsize=64)
def _plan(spec: ScheduleSpec, pp: int, vp: int, microbatches: int) -> dict[int, Plan]:
    stages = [spec.stage(pp, vp, r) for r in range(pp)]
    ops = [spec.rank_ops(pp, vp, r, microbatches) for r in range(pp)]
    position, arrived = [0] * pp, [set() for _ in range(pp)]
    plans: dict[int, Plan] = {r: [[] for _ in range(len(ops[r]) + 1)] for r in range(pp)}
    while any(position[r] < len(ops[r]) for r in range(pp)):
        produced, ran = [], False
        for r, stage in enumerate(stages):
            op = ops[r][position[r]] if position[r] < len(ops[r]) else None
            if op is not None and all(needs(stage, part) in arrived[r] | {None} for part in op.parts):
                produced += [message for part in op.parts if (message := sends(stage, part)) is not None]
                position[r], ran = position[r] + 1, True
        if not ran:
            raise RuntimeError(f"schedule {spec.name} (pp={pp}, vp={vp}, {microbatches} micro batches) cannot make "
                               "progress")
        for r in range(pp):
            mine = sorted((m for m in produced if r in (m.src, m.dst) and not is_local(m)),
                          key=lambda m: (m.pair, m.src, m.dst, m.kind, m.chunk, m.microbatch))
            for _, exchange in itertools.groupby(mine, key=lambda m: m.pair):
                plans[r][position[r]].append(list(exchange))
        for message in produced:
            arrived[message.dst].add(message)
    return plans
