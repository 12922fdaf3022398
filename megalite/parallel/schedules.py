"""Pipeline schedules as data, a communication plan NCCL cannot deadlock on, and one executor.

A schedule is the list of operations each pipeline rank performs, in order: forward or
backward of (model chunk, micro batch). Schedules are functions registered by name with
`@schedule(name)`, so a new one is a new function, not another branch; `schedule_ops` looks
them up. They write Megatron-LM's orders: forward-only (evaluation), GPipe, 1F1B (no
pipelining at pp = 1: gradient accumulation), and interleaved 1F1B with virtual chunks (its
warm-up count and micro batch ordering).

`communication_plan` decides when each message travels. It plays all ranks' lists in lock
step (a rank runs its next operation once its input was produced at an earlier step) and,
after each step, forms one round: every message produced in that step, sent and received in
that round. A rank posts each of its rounds as one batched exchange, in round order, between
the operations where they fall. Sender and receiver post a message in the same round, every
exchange depends only on rounds before it on its own rank, and so the rank holding the lowest
unfinished round can always finish it: no schedule can deadlock, whatever NCCL's blocking,
stream ordering and in-order matching (the NCCL-rule replay test checks the real calls). A
rank may receive a message a few operations before it uses it; the executor waits for an
exchange only when it needs what the exchange received, so sends overlap compute.
Activations are freed as soon as their send completes, so stored activations are bounded by
the schedule's in-flight micro batches.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from megalite.parallel.p2p import Exchange, Message, PipelineComm
from megalite.parallel.pipeline_layout import PipelineStage
from megalite.parallel.timing import Mark, mark, seconds


class OpKind(str, Enum):
    """What an operation computes. F: a chunk's forward; B: its backward (input and weight gradients
    together). Zero-bubble schedules split B into B (input gradient, which the previous rank waits
    for) and W (weight gradient, deferred into bubbles; it consumes and sends no message): W joins
    here, with its branch in run_schedule, when the first such schedule lands."""

    F = "F"
    B = "B"

    def __str__(self) -> str:  # "F", not "OpKind.F", in traces and messages
        return self.value


class Op(NamedTuple):
    """One operation of a rank's schedule; equal to the plain tuple ("F", chunk, microbatch)."""

    kind: OpKind
    chunk: int
    microbatch: int


F, B = OpKind.F, OpKind.B
ForwardStep = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]
Schedule = Callable[[int, int, int, int], list[Op]]  # (pp, vp, rank, microbatches) -> the rank's ops in order
SCHEDULES: dict[str, Schedule] = {}


def schedule(name: str) -> Callable[[Schedule], Schedule]:
    """Register a schedule under `name`, the value of parallel.pipeline_schedule that selects it."""

    def register(build: Schedule) -> Schedule:
        SCHEDULES[name] = build
        return build

    return register


def schedule_ops(name: str, pp: int, vp: int, rank: int, microbatches: int) -> list[Op]:
    """The operations of pipeline rank `rank` under the schedule registered as `name`, in execution order."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; the registered schedules are {sorted(SCHEDULES)}")
    return SCHEDULES[name](pp, vp, rank, microbatches)


@schedule("forward")
def forward_only(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Forwards only, for evaluation: each micro batch through this rank's chunks in turn."""
    return [Op(F, chunk, i) for i in range(m) for chunk in range(vp)]


@schedule("gpipe")
def gpipe(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Every forward, then every backward: simple, but all m micro batches' activations are held."""
    return [Op(F, 0, i) for i in range(m)] + [Op(B, 0, i) for i in range(m)]


@schedule("1f1b")
def one_f_one_b(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """1F1B: after a warm-up of forwards, alternate one forward and one backward, so a rank holds at
    most pp - rank micro batches' activations; interleaved over the rank's chunks when vp > 1."""
    if pp == 1 or vp == 1:  # pp = 1: the whole model is one chunk
        warmup = min(pp - rank - 1, m)
        steady = [op for i in range(m - warmup) for op in (Op(F, 0, warmup + i), Op(B, 0, i))]
        return [Op(F, 0, i) for i in range(warmup)] + steady + [Op(B, 0, i) for i in range(m - warmup, m)]
    return _interleaved(pp, vp, rank, m)


def _interleaved(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B: micro batches go through the chunks in groups of pp, with its
    warm-up count (every forward first when m == pp)."""
    total = m * vp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vp - 1) * pp, total)

    def virtual(k: int, kind: OpKind) -> Op:
        chunk = (k % (pp * vp)) // pp
        return Op(kind, chunk if kind == F else vp - 1 - chunk, (k // (pp * vp)) * pp + k % pp)

    steady = [op for i in range(total - warmup) for op in (virtual(warmup + i, F), virtual(i, B))]
    return [virtual(k, F) for k in range(warmup)] + steady + [virtual(k, B) for k in range(total - warmup, total)]


def needs(stage: PipelineStage, op: Op) -> Message | None:
    """The message `op` consumes: an activation from the previous rank, a gradient from the next."""
    kind, chunk, mb = op
    if kind == F:
        return None if stage.is_first_chunk(chunk) else Message(F, chunk, mb, (stage.rank - 1) % stage.pp, stage.rank)
    return None if stage.is_last_chunk(chunk) else Message(B, chunk, mb, (stage.rank + 1) % stage.pp, stage.rank)


def sends(stage: PipelineStage, op: Op) -> Message | None:
    """The message `op` produces, named by the chunk that consumes it on the receiving rank."""
    kind, chunk, mb = op
    if kind == F:
        dst = (stage.rank + 1) % stage.pp
        return None if stage.is_last_chunk(chunk) else Message(F, chunk + (dst == 0), mb, stage.rank, dst)
    dst = (stage.rank - 1) % stage.pp
    return None if stage.is_first_chunk(chunk) else Message(B, chunk - (stage.rank == 0), mb, stage.rank, dst)


Plan = list[list[list[Message]]]  # per operation index (and one past the last): the rounds to post before it


@functools.lru_cache(maxsize=64)
def communication_plan(name: str, pp: int, vp: int, microbatches: int) -> dict[int, Plan]:
    """For every pipeline rank, the exchanges (rounds of messages) to post before each of its operations."""
    stages = [PipelineStage(pp, vp, r) for r in range(pp)]
    ops = [schedule_ops(name, pp, vp, r, microbatches) for r in range(pp)]
    position, arrived = [0] * pp, [set() for _ in range(pp)]
    plans: dict[int, Plan] = {r: [[] for _ in range(len(ops[r]) + 1)] for r in range(pp)}
    while any(position[r] < len(ops[r]) for r in range(pp)):
        produced, ran = [], False
        for r, stage in enumerate(stages):
            op = ops[r][position[r]] if position[r] < len(ops[r]) else None
            if op is not None and (needs(stage, op) is None or needs(stage, op) in arrived[r]):
                message, ran = sends(stage, op), True
                produced += [message] if message else []
                position[r] += 1
        if not ran:
            raise RuntimeError(f"schedule {name} (pp={pp}, vp={vp}, {microbatches} micro batches) cannot make progress")
        for r in range(pp):
            mine = sorted((m for m in produced if r in (m.src, m.dst)), key=lambda m: (m.src, m.dst))
            if mine:
                plans[r][position[r]].append(mine)
        for message in produced:
            arrived[message.dst].add(message)
    return plans


@dataclass
class Trace:
    """Per-rank record of every operation (its start and end as marks on the device's timeline,
    timing.py), and the peak number of stored activations."""

    device: torch.device = torch.device("cpu")
    events: list[tuple[str, int, int, Mark, Mark]] = field(default_factory=list)
    peak_in_flight: int = 0
    anchor: float | None = None  # the host clock at the first mark: where device time 0 sits among ranks

    def mark(self) -> Mark:
        if self.anchor is None:
            self.anchor = time.perf_counter()
        return mark(self.device)

    def timed_events(self) -> list[tuple[str, int, int, float, float]]:
        """The events with start and end on the host clock (waits for the device): device intervals from
        the first mark, placed at the host time that mark was taken, so ranks' rows line up."""
        if not self.events:
            return []
        origin = self.events[0][3]
        base = origin if isinstance(origin, float) else self.anchor
        return [(kind, chunk, mb, base + seconds(origin, start), base + seconds(origin, end))
                for kind, chunk, mb, start, end in self.events]


class _Mailbox:
    """This rank's side of the plan: posts its rounds, hands out what arrived, frees sent activations."""

    def __init__(self, comm: PipelineComm | None, plan: Plan) -> None:
        self.comm, self.plan = comm, plan
        self.outbox: dict[Message, torch.Tensor] = {}
        self.arriving: dict[Message, Exchange] = {}
        self.sending: list[Exchange] = []

    def post(self, index: int) -> None:
        """Post the rounds that fall before operation `index`; release activations whose send finished."""
        for messages in self.plan[index]:
            exchange = self.comm.exchange(messages, self.outbox)
            self.arriving |= dict.fromkeys(exchange.received, exchange)
            if exchange.sent:
                self.sending.append(exchange)
        self.sending = [exchange for exchange in self.sending if not _released(exchange, wait=False)]

    def take(self, message: Message) -> torch.Tensor:
        exchange = self.arriving.pop(message)
        exchange.wait()
        return exchange.received.pop(message)

    def finish(self) -> None:
        for exchange in self.sending:
            _released(exchange, wait=True)
        if self.arriving or self.outbox:
            raise RuntimeError(f"pipeline messages left over: {[*self.arriving, *self.outbox]}")


def _released(exchange: Exchange, wait: bool) -> bool:
    """Free the data of the activations an exchange sent once it completed; autograd keeps only
    what backward needs (the graph, not the output values)."""
    if not wait and not exchange.is_completed():
        return False
    exchange.wait()
    for message, tensor in exchange.sent.items():
        if message.kind == F:
            tensor.untyped_storage().resize_(0)
    return True


def run_schedule(name: str, microbatches: int, forward_step: ForwardStep, me: PipelineStage, comm: PipelineComm | None,
                 trace: Trace | None = None, before_last_backward: Callable[[int], None] | None = None) -> None:
    """Run this rank's schedule; forward_step(chunk, microbatch, input) returns the chunk's output,
    or on the last chunk the (scaled) loss to differentiate. before_last_backward(chunk) runs before
    each chunk's last backward of the step: where data-parallel gradient reduction can start."""
    ops = schedule_ops(name, me.pp, me.vp, me.rank, microbatches)
    plan = communication_plan(name, me.pp, me.vp, microbatches)[me.rank] if comm is not None else None
    mailbox = _Mailbox(comm, plan) if plan is not None else None
    last_backward = {op.chunk: index for index, op in enumerate(ops) if op.kind == B}
    stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    for index, op in enumerate(ops):
        kind, chunk, mb = op
        if mailbox is not None:
            mailbox.post(index)
        if before_last_backward is not None and last_backward.get(chunk) == index:
            before_last_backward(chunk)
        start = trace.mark() if trace is not None else None
        need = needs(me, op)
        received = mailbox.take(need) if need is not None else None
        if kind == F:
            hidden = None if received is None else received.requires_grad_()
            result = forward_step(chunk, mb, hidden)
            if torch.is_grad_enabled():
                stored[(chunk, mb)] = (hidden, result)
        else:
            hidden, out = stored.pop((chunk, mb))
            torch.autograd.backward(out, received)
            result = None if hidden is None else hidden.grad
        message = sends(me, op)
        if message is not None:
            mailbox.outbox[message] = result
        if trace is not None:
            trace.events.append((kind, chunk, mb, start, trace.mark()))
            trace.peak_in_flight = max(trace.peak_in_flight, len(stored))
    if mailbox is not None:
        mailbox.post(len(ops))
        mailbox.finish()
