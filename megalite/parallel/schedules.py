"""Pipeline schedules as data, and one executor that runs any of them.

A schedule is the list of operations each pipeline rank performs, in order: forward or
backward of (model chunk, micro batch). `schedule_ops` writes Megatron-LM's orders:
no pipelining (gradient accumulation), GPipe, 1F1B, and interleaved 1F1B with virtual
chunks (its warm-up count and micro batch ordering). The executor runs the list: an
operation waits only for the tensor it consumes; every send is asynchronous. Receives are
posted in the order the peer sends (computed from the peer's own list), which is the
order NCCL matches messages in, so no shape handshake or extra synchronisation is needed,
and the run is deadlock-free for every schedule whose operations respect their data
dependencies (all of these do). Activations are freed as soon as their send completes,
so stored activations are bounded by the schedule's in-flight micro batches.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megalite.parallel.p2p import ACTIVATION, GRADIENT, PipelineComm

Op = tuple[str, int, int]  # ("F" | "B", chunk, micro batch)
ForwardStep = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]


def schedule_ops(name: str, pp: int, vp: int, rank: int, microbatches: int) -> list[Op]:
    """The operations of pipeline rank `rank`, in execution order ("1f1b" is interleaved when vp > 1;
    "forward" is forward-only, for evaluation)."""
    m = microbatches
    if name == "forward":
        return [("F", chunk, i) for i in range(m) for chunk in range(vp)]
    if name == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if pp == 1:
        return [op for i in range(m) for op in (("F", 0, i), ("B", 0, i))]
    if vp == 1:
        warmup = min(pp - rank - 1, m)
        steady = [op for i in range(m - warmup) for op in (("F", 0, warmup + i), ("B", 0, i))]
        return [("F", 0, i) for i in range(warmup)] + steady + [("B", 0, i) for i in range(m - warmup, m)]
    total = m * vp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vp - 1) * pp, total)

    def virtual(k: int, forward: bool) -> Op:
        chunk = (k % (pp * vp)) // pp
        return ("F" if forward else "B", chunk if forward else vp - 1 - chunk, (k // (pp * vp)) * pp + k % pp)

    steady = [op for i in range(total - warmup) for op in (virtual(warmup + i, True), virtual(i, False))]
    return [virtual(k, True) for k in range(warmup)] + steady + [virtual(k, False) for k in range(total - warmup, total)]


@dataclass
class StageInfo:
    """Where a rank sits in the pipeline, for message routing."""

    pp: int
    vp: int
    rank: int

    def is_first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.rank == self.pp - 1 and chunk == self.vp - 1


def outgoing(op: Op, sender: StageInfo) -> tuple[int, int, tuple] | None:
    """(tag, destination pipeline rank, message key) of what `op` sends, or None."""
    kind, chunk, mb = op
    if kind == "F" and not sender.is_last(chunk):
        dst = (sender.rank + 1) % sender.pp
        return ACTIVATION, dst, ("F", chunk + (dst == 0), mb)
    if kind == "B" and not sender.is_first(chunk):
        dst = (sender.rank - 1) % sender.pp
        return GRADIENT, dst, ("B", chunk - (sender.rank == 0), mb)
    return None


@dataclass
class Trace:
    """Per-rank record of every operation, and the peak number of stored activations."""

    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    peak_in_flight: int = 0


class _Inbox:
    """Receives from one peer, posted in the peer's send order; `get` waits for one message."""

    def __init__(self, comm: PipelineComm, peer: StageInfo, peer_global_rank: int, me: StageInfo, peer_ops: list[Op]) -> None:
        messages = [outgoing(op, peer) for op in peer_ops]
        self.expected = deque(key for message in messages if message and message[1] == me.rank for key in message[2:])
        self.comm, self.peer, self.posted = comm, peer_global_rank, {}

    def get(self, key: tuple) -> torch.Tensor:
        while key not in self.posted:
            next_key = self.expected.popleft()
            buffer = torch.empty(self.comm.shape, dtype=self.comm.dtype, device=self.comm.topology.device)
            tag = ACTIVATION if next_key[0] == "F" else GRADIENT
            self.posted[next_key] = (dist.irecv(buffer, self.peer, tag=tag), buffer)
        work, buffer = self.posted.pop(key)
        work.wait()
        return buffer


def run_schedule(name: str, microbatches: int, forward_step: ForwardStep, me: StageInfo, comm: PipelineComm | None,
                 trace: Trace | None = None, before_last_backward: Callable[[int], None] | None = None) -> None:
    """Run this rank's schedule; forward_step(chunk, microbatch, input) returns the chunk's output,
    or on the last chunk the (scaled) loss to differentiate. before_last_backward(chunk) runs before
    each chunk's last backward of the step: where data-parallel gradient reduction can start."""
    ops = schedule_ops(name, me.pp, me.vp, me.rank, microbatches)
    last_backward = {op[1]: index for index, op in enumerate(ops) if op[0] == "B"}
    inboxes = {}
    if comm is not None:
        t = comm.topology
        for peer_rank, global_rank in {(me.rank - 1) % me.pp: t.prev_rank, (me.rank + 1) % me.pp: t.next_rank}.items():
            peer = StageInfo(me.pp, me.vp, peer_rank)
            inboxes[peer_rank] = _Inbox(comm, peer, global_rank, me, schedule_ops(name, me.pp, me.vp, peer_rank, microbatches))
    stored: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    sending: list[tuple[dist.Work, torch.Tensor, bool]] = []
    for index, op in enumerate(ops):
        kind, chunk, mb = op
        if before_last_backward is not None and last_backward.get(chunk) == index:
            before_last_backward(chunk)
        start = time.perf_counter()
        if kind == "F":
            hidden = None if me.is_first(chunk) else inboxes[(me.rank - 1) % me.pp].get(("F", chunk, mb)).requires_grad_()
            out = forward_step(chunk, mb, hidden)
            if torch.is_grad_enabled():
                stored[(chunk, mb)] = (hidden, out)
            result = out
        else:
            hidden, out = stored.pop((chunk, mb))
            grad = None if me.is_last(chunk) else inboxes[(me.rank + 1) % me.pp].get(("B", chunk, mb))
            torch.autograd.backward(out, grad)
            result = None if hidden is None else hidden.grad
        message = outgoing(op, me)
        if message is not None:
            tag, dst, _ = message
            peer = comm.topology.next_rank if tag == ACTIVATION else comm.topology.prev_rank
            sending.append((dist.isend(result.detach().contiguous(), peer, tag=tag), result, kind == "F"))
        sending = _release_completed(sending)
        if trace is not None:
            trace.events.append((kind, chunk, mb, start, time.perf_counter()))
            trace.peak_in_flight = max(trace.peak_in_flight, len(stored))
    for work, tensor, activation in sending:
        work.wait()
        if activation:
            tensor.untyped_storage().resize_(0)


def _release_completed(sending: list) -> list:
    """Free the data of activations whose send finished; autograd keeps only what backward needs."""
    pending = []
    for work, tensor, activation in sending:
        if work.is_completed():
            work.wait()
            if activation:
                tensor.untyped_storage().resize_(0)
        else:
            pending.append((work, tensor, activation))
    return pending
