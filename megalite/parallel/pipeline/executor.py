"""One executor for every pipeline schedule: a rank runs its operations in order, posting the communication
plan's exchanges (plan.py) between them. A paired operation (DualPipe's F&B) takes both parts' inputs, runs
them through the pipeline's pair runner (overlap.py) and sends both parts' outputs.

A rank may receive a message a few operations before it uses it; the executor waits for an exchange only when
it needs what the exchange received, so sends overlap compute. Activations are freed as soon as their send
completes, so stored activations are bounded by the schedule's in-flight micro batches. Whoever wants to watch
a step (the pipeline trace, the activation-memory measurement) passes a `ScheduleObserver`: it is told before
and after every operation, with what this rank holds in flight.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from megalite.parallel.p2p import Exchange, Message, PipelineComm
from megalite.parallel.pipeline.ops import F, Op, ScheduleOp, W, weight_gradient_ops
from megalite.parallel.pipeline.overlap import SEQUENTIAL, PairRunner
from megalite.parallel.pipeline.plan import Plan, communication_plan, is_local, needs, sends
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import PipelineStage
from megalite.parallel.storage import resize_storage
from megalite.parallel.timing import Mark, mark, seconds
from megalite.parallel.weight_grads import WeightGradients, deferred

ForwardStep = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]


class ScheduleObserver:
    """Told of every operation a rank runs: override what you watch."""

    def before(self, op: ScheduleOp) -> None:
        """`op` is about to run."""

    def after(self, op: ScheduleOp, in_flight: InFlight) -> None:
        """`op` ran; `in_flight`: what this rank now holds for later operations."""

    def after_part(self, part: Op, in_flight: InFlight) -> None:
        """One part of a paired operation ran (the other may still be under way)."""


@dataclass
class PeakInFlight(ScheduleObserver):
    """The peak number of micro batches in flight on this rank (forward run, gradients not all computed: stored
    activations, and under a zero-bubble schedule weight-gradient inputs held for W), and nothing else: what a
    timed step can watch without adding the host time of a trace between its operations."""

    peak_in_flight: int = field(default=0, kw_only=True)  # after the fields of a subclass, e.g. Trace(device)

    def after(self, op: ScheduleOp, in_flight: InFlight) -> None:
        self.peak_in_flight = max(self.peak_in_flight, in_flight.count)


@dataclass
class Trace(PeakInFlight):
    """Per-rank record of every operation (its start and end as marks on the device's timeline,
    timing.py; a paired operation's two parts each with the pair's), and the peak number of micro batches in
    flight."""

    device: torch.device = torch.device("cpu")
    events: list[tuple[str, int, int, Mark, Mark, bool]] = field(default_factory=list)
    anchor: float | None = None  # the host clock at the first mark: where device time 0 sits among ranks
    started: Mark | None = field(default=None, repr=False)  # the running operation's start

    def before(self, op: ScheduleOp) -> None:
        self.started = self.mark()

    def after(self, op: ScheduleOp, in_flight: InFlight) -> None:
        end = self.mark()
        self.events += [(part.kind, part.chunk, part.microbatch, self.started, end, len(op.parts) > 1)
                        for part in op.parts]
        super().after(op, in_flight)

    def mark(self) -> Mark:
        if self.anchor is None:
            self.anchor = time.perf_counter()
        return mark(self.device)

    def timed_events(self) -> list[tuple[str, int, int, float, float, bool]]:
        """The events (kind, chunk, micro batch, start, end, part of a pair) with start and end on the host clock
        (waits for the device): device intervals from the first mark, placed at the host time that mark was
        taken, so ranks' rows line up."""
        if not self.events:
            return []
        origin = self.events[0][3]
        base = origin if isinstance(origin, float) else self.anchor
        return [(kind, chunk, mb, base + seconds(origin, start), base + seconds(origin, end), paired)
                for kind, chunk, mb, start, end, paired in self.events]


class _Mailbox:
    """This rank's side of the plan: posts its rounds, hands out what arrived (or what one of its own chunks
    handed to another), frees sent activations. Without a plan (pp = 1) it only holds hand-offs.

    Sends are released oldest first per neighbour pair: one pair's exchanges run on its communicator in post
    order, so a later one is never done before an earlier one, and a post looks at one exchange per pair, not at
    every send still in flight (a gloo send reports completion only once waited on: those would all be looked
    at on every post, a cost in the host's time between operations that grows with the step)."""

    def __init__(self, comm: PipelineComm | None, plan: Plan | None) -> None:
        self.comm, self.plan = comm, plan
        self.outbox: dict[Message, torch.Tensor] = {}
        self.arriving: dict[Message, Exchange] = {}
        self.sending: dict[tuple[int, int], deque[Exchange]] = defaultdict(deque)
        self.handed: dict[Message, torch.Tensor] = {}

    def post(self, index: int) -> None:
        """Post the rounds that fall before operation `index`; release activations whose send finished."""
        for messages in self.plan[index] if self.plan is not None else []:
            exchange = self.comm.exchange(messages, self.outbox)
            self.arriving |= dict.fromkeys(exchange.received, exchange)
            if exchange.sent:
                self.sending[messages[0].pair].append(exchange)
        for queue in self.sending.values():
            while queue and _released(queue[0], wait=False):
                queue.popleft()

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
        for exchange in itertools.chain.from_iterable(self.sending.values()):
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
            resize_storage(tensor, 0)
    return True


@dataclass
class InFlight:
    """What this rank's operations hand each other: forwards' (input, output) until their backward, and each B
    that has a W (`deferring`: its chunk and micro batch) its weight-gradient work until that W."""

    forward_step: ForwardStep
    deferring: frozenset[tuple[int, int]]
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
        split = (chunk, mb) in self.deferring
        with deferred(self.weights.setdefault((chunk, mb), WeightGradients())) if split else nullcontext():
            torch.autograd.backward(out, received)
        if self.after_backward is not None:
            self.after_backward()
        return None if hidden is None else hidden.grad

    @property
    def count(self) -> int:
        """Micro batches (of a chunk) whose forward ran and whose gradients are not all computed."""
        return len(self.stored) + len(self.weights)

    @property
    def weight_work(self) -> list[WeightGradients]:
        """The weight-gradient work queued by B operations whose W has not run."""
        return list(self.weights.values())


@dataclass(frozen=True)
class _Program:
    """A rank's part of a schedule, the same every step: its operations, what each part of each consumes and
    produces (plan.py's needs and sends), the chunks whose last weight gradients each operation computes, and the
    (chunk, micro batch) whose backward leaves its weight gradients to a W. Worked out once (`_program`), not at
    each step's start or between operations, where its host time would delay the next one."""

    ops: list[ScheduleOp]
    consumes: list[list[Message | None]]
    produces: list[list[Message | None]]
    last_grads: dict[int, list[int]]
    deferring: frozenset[tuple[int, int]]


@functools.lru_cache(maxsize=64)
def _program(spec: ScheduleSpec, me: PipelineStage, microbatches: int) -> _Program:
    ops = spec.rank_ops(me.pp, me.vp, me.rank, microbatches)
    last: dict[int, int] = {}
    for (chunk, _), index in weight_gradient_ops(ops).items():
        last[chunk] = max(last.get(chunk, index), index)
    last_grads: dict[int, list[int]] = defaultdict(list)
    for chunk in sorted(last):
        last_grads[last[chunk]].append(chunk)
    return _Program(ops, [[needs(me, part) for part in op.parts] for op in ops],
                    [[sends(me, part) for part in op.parts] for op in ops], dict(last_grads),
                    frozenset((op.chunk, op.microbatch) for op in ops if op.kind == W))


def run_schedule(schedule: str | ScheduleSpec, microbatches: int, forward_step: ForwardStep, me: PipelineStage,
                 comm: PipelineComm | None, observers: Sequence[ScheduleObserver] = (),
                 before_last_grads: Callable[[int], None] | None = None,
                 after_backward: Callable[[], None] | None = None, pairs: PairRunner = SEQUENTIAL) -> None:
    """Run this rank's schedule; forward_step(chunk, microbatch, input) returns the chunk's output,
    or on the last chunk the (scaled) loss to differentiate. before_last_grads(chunk) runs before the
    operation that computes each chunk's last weight gradients of the step (its last backward, or its last
    W): where data-parallel gradient reduction can start. after_backward() runs after every backward
    (ZeRO-3 frees the parameters it gathered for it). `pairs` runs paired operations (overlap.py)."""
    spec = schedule_spec(schedule)
    if me.order != spec.chunk_order:
        raise ValueError(f"schedule {spec.name} runs on stages in the {spec.chunk_order.name} chunk order, not "
                         f"{me.order.name}: build them with its spec (ScheduleSpec.stage)")
    program = _program(spec, me, microbatches)
    mailbox = _Mailbox(comm, communication_plan(spec, me.pp, me.vp, microbatches)[me.rank] if comm else None)
    in_flight = InFlight(forward_step, program.deferring, after_backward)
    for index, op in enumerate(program.ops):
        mailbox.post(index)
        if before_last_grads is not None:
            for chunk in program.last_grads.get(index, ()):
                before_last_grads(chunk)
        for observer in observers:
            observer.before(op)
        _run(op, program.consumes[index], program.produces[index], mailbox, in_flight, pairs, observers)
        for observer in observers:
            observer.after(op, in_flight)
    mailbox.post(len(program.ops))
    mailbox.finish()
    if in_flight.count:
        raise RuntimeError(f"schedule {spec.name} left forwards without backward or weight gradients: "
                           f"{[*in_flight.stored, *in_flight.weights]}")


def _run(op: ScheduleOp, consumes: list[Message | None], produces: list[Message | None], mailbox: _Mailbox,
         in_flight: InFlight, pairs: PairRunner, observers: Sequence[ScheduleObserver]) -> None:
    """Take what `op`'s parts consume, run them (a pair through `pairs`), send what they produce."""
    received = [None if need is None else mailbox.take(need) for need in consumes]

    def run_part(part: Op, x: torch.Tensor | None) -> torch.Tensor | None:
        result = in_flight.run(part, x)
        for observer in observers:
            observer.after_part(part, in_flight)
        return result

    if len(op.parts) == 1:
        results = [in_flight.run(op, received[0])]
    else:
        results = pairs.run([functools.partial(run_part, part, x) for part, x in zip(op.parts, received)])
    for message, result in zip(produces, results):
        if message is not None:
            mailbox.send(message, result)
