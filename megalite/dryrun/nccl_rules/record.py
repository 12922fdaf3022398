"""Recording what every call of this process's observed process groups posts and waits on (the seam:
parallel/observed.py; the rules it is checked against: nccl_rules/__init__.py)."""

from __future__ import annotations

import hashlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import is_fake

from megalite.parallel import observed
from megalite.parallel.observed import CommObserver, GroupCall, ObservedGroup, observing

P2P_FUNCTIONS = ("isend", "irecv", "send", "recv")
P2P_OPERATIONS = ("send", "recv", "recv_anysource")  # a group's operations that carry one message
# Which argument of a group's collective holds the tensor every member must agree on (its input; a scatter's
# output). A barrier and an all-to-all have none (an all-to-all's members agree pairwise: its splits).
_AGREED = {"allreduce": 0, "allreduce_coalesced": 0, "broadcast": 0, "reduce": 0, "allgather": 1,
           "allgather_coalesced": 1, "all_gather_single": 1, "reduce_scatter_single": 1, "gather": 1,
           "reduce_scatter": 0, "scatter": 0}
_OURS = (__file__, observed.__file__)  # frames between torch's function and the recorder


@dataclass
class Message:
    """One send or receive of a call."""

    send: bool
    peer: int  # global rank
    nbytes: int
    dtype: str
    digest: str | None = None  # bytes sent (at post) or received (after the wait)

    def describe(self, rank: int) -> str:
        return f"{'send' if self.send else 'recv'} {rank}->{self.peer}" if self.send else f"recv {self.peer}->{rank}"


@dataclass
class Call:
    rank: int
    index: int  # post order on this rank
    name: str  # "batch_isend_irecv", "isend", ... or the collective's name
    comm: str  # the process group's name
    members: tuple[int, ...]  # global ranks of the group
    messages: list[Message] = field(default_factory=list)
    nbytes: int | None = None  # collectives: the size every member must agree on
    dtype: str | None = None
    splits: tuple[list[int], list[int]] | None = None  # all_to_all_single: bytes sent to, received from each member
    where: str = ""  # the caller's file:line, for reports
    desc: str = ""  # the group's description ("tensor-parallel", ...), for reports
    payload: int = 0  # a collective's size as NCCL's tests count it (the whole tensor); a rank's sends


    @property
    def single(self) -> bool:
        return self.name in P2P_FUNCTIONS

    def describe(self) -> str:
        parts = ", ".join(m.describe(self.rank) for m in self.messages) or f"{self.nbytes} bytes {self.dtype}"
        return f"rank {self.rank} call #{self.index} {self.name}({parts}) on group {self.comm} at {self.where}"


@dataclass
class RankRecord:
    """What one rank posted and waited on, in order: ("post", Call) and ("wait", call index)."""

    rank: int
    events: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def calls(self) -> list[Call]:
        return [item for kind, item in self.events if kind == "post"]


def _digest(tensor: torch.Tensor) -> str | None:
    """A hash of the tensor's bytes; None for a tensor without data (fake or meta: the dry run)."""
    if tensor.is_meta or is_fake(tensor):
        return None
    raw = tensor.detach().reshape(-1).view(torch.uint8).cpu().clone().numpy().tobytes()  # a copy: numpy pins storage
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _caller() -> str:
    """The first frame outside torch, the observed group and this file: the code that communicated."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and path not in _OURS:
            return f"{'/'.join(path.rsplit('/', 2)[-2:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class CommRecorder(CommObserver):
    """While active, records every call the observed process groups of this process post and every wait on them
    (one recorder per process). One call of torch's (a `batch_isend_irecv` with all its sends and receives, an
    `all_gather_object` with its two gathers) is one recorded call, named as torch's function is. `digests`: hash
    the bytes each message carries; off where no bytes move (real tensors on the fake process group, whose
    receives stay as they were allocated), so that only sizes and order are checked, as for fake tensors."""

    def __init__(self, rank: int, digests: bool = True) -> None:
        self.record = RankRecord(rank)
        self._digests = digests
        self._posted = 0  # calls posted so far: the next call's index
        self._waited: set[int] = set()
        # each operation in flight: its call and its receives (gone with the operation's work, as its buffers)
        self._calls: weakref.WeakKeyDictionary[GroupCall, tuple[Call, list]] = weakref.WeakKeyDictionary()
        self._open: tuple[Any, Call] | None = None  # torch's function being run (its frame) and its call
        self._observing = observing(self)

    def __enter__(self) -> CommRecorder:
        if dist.is_initialized() and not isinstance(c10d._get_default_group(), ObservedGroup):
            raise RuntimeError(f"CommRecorder sees the calls of observed process groups only, and this process's "
                               f"group runs on {dist.get_backend()!r}: create it with backend "
                               f"megalite.parallel.observed.GLOO (spawn.run_on_ranks does) or FAKE (the dry run)")
        self._observing.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._observing.__exit__(*exc)
        self._open = None  # the frame of torch's last function, with what it held

    def posting(self, operation: GroupCall) -> None:
        frame = _torch_function()
        if frame is not None and self._open is not None and self._open[0] is frame:
            call = self._open[1]  # one more operation of the same call of torch's
        else:
            call = self._new_call(operation, _call_name(frame, operation))
            self._open = (frame, call)
        received = self._messages(call, operation)
        call.payload = _payload(call, operation)
        self._calls[operation] = (call, received)
        if operation.operation == "all_to_all_single":  # one operation per call: hold no frame (its buffers) past it
            self._open = None

    def waited(self, operation: GroupCall) -> None:
        call, received = self._calls[operation]
        if call.index not in self._waited:
            self._waited.add(call.index)
            self.record.events.append(("wait", call.index))
        for message, buffer in received:
            message.digest = _digest(buffer) if self._digests else None

    def _new_call(self, operation: GroupCall, name: str) -> Call:
        group = operation.group
        call = Call(self.record.rank, self._posted, name, group.group_name,
                    tuple(dist.get_process_group_ranks(group)), where=_caller(), desc=group.group_desc)
        if operation.operation == "all_to_all_single":  # uneven splits: members agree pairwise, not on one size
            call.dtype = str(operation.arguments[1].dtype)
            call.splits = _all_to_all_splits(operation, len(call.members))
        elif operation.operation not in P2P_OPERATIONS:
            tensor = _agreed_tensor(operation)
            if tensor is not None:
                call.nbytes, call.dtype = tensor.numel() * tensor.element_size(), str(tensor.dtype)
        self.record.events.append(("post", call))
        self._posted += 1
        return call

    def _messages(self, call: Call, operation: GroupCall) -> list[tuple[Message, torch.Tensor]]:
        """Adds a send's or receive's message to the call; returns the receive's, to digest once it is there."""
        if operation.operation not in P2P_OPERATIONS:
            return []
        if operation.operation == "recv_anysource":
            raise ValueError(f"{call.describe()}: a receive from any source has no NCCL counterpart to replay")
        (tensor,), peer = operation.arguments[0], operation.arguments[1]
        send = operation.operation == "send"
        message = Message(send, dist.get_global_rank(operation.group, peer), tensor.numel() * tensor.element_size(),
                          str(tensor.dtype))
        call.messages.append(message)
        if send:
            message.digest = _digest(tensor) if self._digests else None
            return []
        return [(message, tensor)]


def _torch_function() -> Any:
    """The frame of the outermost torch.distributed function in the calls that led here (`batch_isend_irecv` for
    each of its sends), or of megalite's function that posted them as one batch (observed.one_batch: it calls
    the group itself), or None where neither posted the operation."""
    frame, found = sys._getframe(1), None
    while frame is not None and frame.f_code.co_filename in _OURS:
        frame = frame.f_back
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        if frame.f_code.co_filename == c10d.__file__:
            found = frame
        frame = frame.f_back
    if found is None and frame is not None and frame.f_code in observed.BATCHES:
        return frame
    return found


def _call_name(frame: Any, operation: GroupCall) -> str:
    """torch's function's name; megalite's batch is named as torch's, `batch_isend_irecv` (what NCCL runs is the
    same); an operation no function of either posted, by its own name."""
    if frame is None:
        return operation.operation
    return "batch_isend_irecv" if frame.f_code in observed.BATCHES else frame.f_code.co_name


def _agreed_tensor(operation: GroupCall) -> torch.Tensor | None:
    """The tensor whose size every member of a collective must agree on: its input (for a scatter, the output);
    None for a barrier."""
    position = _AGREED.get(operation.operation)
    if position is None or position >= len(operation.arguments):
        return None
    value = operation.arguments[position]
    while isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value


def _all_to_all_splits(operation: GroupCall, members: int) -> tuple[list[int], list[int]]:
    """Bytes an all_to_all_single sends to and receives from each member, in group order (even splits when
    none are given)."""
    output, sent, output_sizes, sent_sizes = operation.arguments[:4]

    def per_member(tensor: torch.Tensor, sizes: list[int]) -> list[int]:
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() and len(tensor) else 0
        rows = sizes if sizes else [len(tensor) // members] * members
        return [n * row for n in rows]

    return per_member(sent, sent_sizes), per_member(output, output_sizes)


def _payload(call: Call, operation: GroupCall) -> int:
    """Sends: their bytes; an all-to-all: the rows it sends; a collective: its largest tensor (the whole
    gathered or reduce-scattered buffer, NCCL's tests' size)."""
    if call.messages:
        return sum(m.nbytes for m in call.messages if m.send)
    if call.splits is not None:
        return sum(call.splits[0])
    return max((t.numel() * t.element_size() for t in operation.tensors()), default=0)
