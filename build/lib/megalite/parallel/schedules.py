"""Pipeline schedules as data, a communication plan NCCL cannot deadlock on, and one executor.

A schedule is the list of operations each pipeline rank performs, in order: forward, backward or
weight-gradient of (model chunk, micro batch). Schedules are functions registered by name with
`@schedule(name)`, so a new one is a new function, not another branch; `schedule_ops` looks
them up. Here are Megatron-LM's orders: forward-only (evaluation), GPipe, 1F1B (no pipelining at
pp = 1: gradient accumulation), and interleaved 1F1B with virtual chunks (its warm-up count and
micro batch ordering); the zero-bubble schedules, whose backward is split into B and W, are in
zero_bubble.py. Which rank holds which chunk is the stage's placement (pipeline_layout.py): a
message goes to whoever holds the next (or previous) chunk, which under ZB-V may be the sender
itself, a hand-off that never touches the network.

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
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from megalite.parallel.p2p import Exchange, Message, PipelineComm
from megalite.parallel.pipeline_layout import PipelineStage, placement_of
from megalite.parallel.timing import Mark, mark, seconds
from megalite.parallel.weight_grads import WeightGradients, deferred


class OpKind(str, Enum):
    """What an operation computes. F: a chunk's forward; B: its backward, input and weight gradients
    together, unless the schedule has W operations: then B computes the input gradients only (what the
    previous rank waits for) and W, later, the weight gradients of that chunk and micro batch
    (weight_grads.py); W consumes and sends no message."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:  # "F", not "OpKind.F", in traces and messages
        return self.value


class Op(NamedTuple):
    """One operation of a rank's schedule; equal to the plain tuple ("F", chunk, microbatch)."""

    kind: OpKind
    chunk: int
    microbatch: int


F, B, W = OpKind.F, OpKind.B, OpKind.W
ForwardStep = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]
Schedule = Callable[[int, int, int, int], list[Op]]  # (pp, vp, rank, microbatches) -> the rank's ops in order
# (pp, vp, microbatches, T_F, T_B, T_W) -> idle share of the ideal step m (T_F + T_B + T_W); T: a rank's whole stage
Bubble = Callable[[int, int, int, float, float, float], float]
SCHEDULES: dict[str, Schedule] = {}
BUBBLES: dict[str, Bubble] = {}
SPLIT: set[str] = set()  # schedules with W operations


def schedule(name: str, bubble: Bubble | None = None, split: bool = False) -> Callable[[Schedule], Schedule]:
    """Register a schedule under `name`, the value of parallel.pipeline_schedule that selects it, with the
    formula of its bubble (none for evaluation's forward-only schedule); `split`: its backwards are split
    into B and W operations."""

    def register(build: Schedule) -> Schedule:
        SCHEDULES[name] = build
        if bubble is not None:
            BUBBLES[name] = bubble
        if split:
            SPLIT.add(name)
        return build

    return register


def splits_backward(name: str) -> bool:
    """Whether schedule `name` computes weight gradients in W operations of their own."""
    return name in SPLIT


def schedule_ops(name: str, pp: int, vp: int, rank: int, microbatches: int) -> list[Op]:
    """The operations of pipeline rank `rank` under the schedule registered as `name`, in execution order."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; the registered schedules are {sorted(SCHEDULES)}")
    return SCHEDULES[name](pp, vp, rank, microbatches)


def bubble_fraction(name: str, pp: int, vp: int, microbatches: int, t_f: float = 1.0, t_b: float = 1.0,
                    t_w: float = 1.0) -> float:
    """Schedule `name`'s idle share of the ideal step, given a rank's forward, input-gradient and weight-gradient
    times (only their ratios matter)."""
    return BUBBLES[name](pp, vp, microbatches, t_f, t_b, t_w)


def _one_f_one_b_bubble(pp: int, vp: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """Megatron-LM's (pp - 1) / (vp * m): each of the first pp - 1 micro batches' forward and whole backward
    (B and W together) idles some rank; interleaving cuts each chunk's share by vp."""
    return (pp - 1) / (vp * m)


@schedule("forward")
def forward_only(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Forwards only, for evaluation: each micro batch through this rank's chunks in turn."""
    return [Op(F, chunk, i) for i in range(m) for chunk in range(vp)]


@schedule("gpipe", bubble=_one_f_one_b_bubble)
def gpipe(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Every forward, then every backward: simple, but all m micro batches' activations are held."""
    return [Op(F, 0, i) for i in range(m)] + [Op(B, 0, i) for i in range(m)]


@schedule("1f1b", bubble=_one_f_one_b_bubble)
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


Plan = list[list[list[Message]]]  # per operation index (and one past the last): the rounds to post before it


@functools.lru_cache(maxsize=64)
def communication_plan(name: str, pp: int, vp: int, microbatches: int) -> dict[int, Plan]:
    """For every pipeline rank, the exchanges (rounds of messages) to post before each of its operations. A
    hand-off to the same rank is in no round: it is there for the rank's next operations."""
    stages = [PipelineStage(pp, vp, r, placement=placement_of(name)) for r in range(pp)]
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
            mine = [m for m in produced if r in (m.src, m.dst) and not is_local(m)]
            mine.sort(key=lambda m: (m.src, m.dst))
            if mine:
                plans[r][position[r]].append(mine)
        for message in produced:
            arrived[message.dst].add(message)
    return plans


@dataclass
class Trace:
    """Per-rank record of every operation (its start and end as marks on the device's timeline,
    timing.py), and the peak number of micro batches in flight (forward run, gradients not all computed:
    stored activations, and under a zero-bubble schedule weight-gradient inputs held for W)."""

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
    """This rank's side of the plan: posts its rounds, hands out what arrived (or what one of its own chunks
    handed to another), frees sent activations. Without a plan (pp = 1) it only holds hand-offs."""

    def __init__(self, comm: PipelineComm | None, plan: Plan | None) -> None:
        self.comm, self.plan = comm, plan
        self.outbox: dict[Message, torch.Tensor] = {}
        self.arriving: dict[Message, Exchange] = {}
        self.sending: list[Exchange] = []
        self.handed: dict[Message, torch.Tensor] = {}

    def post(self, index: int) -> None:
        """Post the rounds that fall before operation `index`; release activations whose send finished."""
        for messages in self.plan[index] if self.plan is not None else []:
            exchange = self.comm.exchange(messages, self.outbox)
            self.arriving |= dict.fromkeys(exchange.received, exchange)
            if exchange.sent:
                self.sending.append(exchange)
        self.sending = [exchange for exchange in self.sending if not _released(exchange, wait=False)]

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        """Queue `tensor` for its round; a hand-off between this rank's chunks is kept, not sent (nor freed: the
        next chunk's forward reads it), an activation detached so that the next chunk's graph starts there."""
        if is_local(message):
            self.handed[message] = tensor.detach() if message.kind == F else tensor
        else:
            self.outbox[message] = tensor

    def take(self, message: Message) -> torch.Tensor:
        if is_local(message):
            return self.handed.pop(message)
        exchange = self.arriving.pop(message)
        exchange.wait()
        return exchange.received.pop(message)

    def finish(self) -> None:
        for exchange in self.sending:
            _released(exchange, wait=True)
        if self.arriving or self.outbox or self.handed:
            raise RuntimeError(f"pipeline messages left over: {[*self.arriving, *self.outbox, *self.handed]}")


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


@dataclass
class _Chunks:
    """What this rank's operations hand each other: forwards' (input, output) until their backward, and under a
    split backward each B's weight-gradient work until its W."""

    forward_step: ForwardStep
    split: bool
    after_backward: Callable[[], None] | None
    stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    weights: dict[tuple[int, int], WeightGradients] = field(default_factory=dict)

    def run(self, op: Op, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run `op` on what it received; returns what it sends (an activation or an input gradient)."""
        kind, chunk, mb = op
        if kind == F:
            hidden = None if received is None else received.requires_grad_()
            result = self.forward_step(chunk, mb, hidden)
            if torch.is_grad_enabled():
                self.stored[(chunk, mb)] = (hidden, result)
            return result
        if kind == W:
            self.weights.pop((chunk, mb)).run()
            return None
        hidden, out = self.stored.pop((chunk, mb))
        with deferred(self.weights.setdefault((chunk, mb), WeightGradients())) if self.split else nullcontext():
            torch.autograd.backward(out, received)
        if self.after_backward is not None:
            self.after_backward()
        return None if hidden is None else hidden.grad

    @property
    def in_flight(self) -> int:
        """Micro batches (of a chunk) whose forward ran and whose gradients are not all computed."""
        return len(self.stored) + len(self.weights)


def run_schedule(name: str, microbatches: int, forward_step: ForwardStep, me: PipelineStage, comm: PipelineComm | None,
                 trace: Trace | None = None, before_last_grads: Callable[[int], None] | None = None,
                 after_backward: Callable[[], None] | None = None) -> None:
    """Run this rank's schedule; forward_step(chunk, microbatch, input) returns the chunk's output,
    or on the last chunk the (scaled) loss to differentiate. before_last_grads(chunk) runs before the
    operation that computes each chunk's last weight gradients of the step (its last backward, or its last
    W): where data-parallel gradient reduction can start. after_backward() runs after every backward
    (ZeRO-3 frees the parameters it gathered for it)."""
    ops = schedule_ops(name, me.pp, me.vp, me.rank, microbatches)
    split = any(op.kind == W for op in ops)
    mailbox = _Mailbox(comm, communication_plan(name, me.pp, me.vp, microbatches)[me.rank] if comm else None)
    last_grads = {op.chunk: index for index, op in enumerate(ops) if op.kind == (W if split else B)}
    chunks = _Chunks(forward_step, split, after_backward)
    for index, op in enumerate(ops):
        mailbox.post(index)
        if before_last_grads is not None and last_grads.get(op.chunk) == index:
            before_last_grads(op.chunk)
        start = trace.mark() if trace is not None else None
        need = needs(me, op)
        result = chunks.run(op, mailbox.take(need) if need is not None else None)
        message = sends(me, op)
        if message is not None:
            mailbox.send(message, result)
        if trace is not None:
            trace.events.append((op.kind, op.chunk, op.microbatch, start, trace.mark()))
            trace.peak_in_flight = max(trace.peak_in_flight, chunks.in_flight)
    mailbox.post(len(ops))
    mailbox.finish()
    if chunks.in_flight:
        raise RuntimeError(f"schedule {name} left forwards without backward or weight gradients: "
                           f"{[*chunks.stored, *chunks.weights]}")


from megalite.parallel import zero_bubble  # noqa: E402,F401  (registers zb-h1 and zb-v)
