"""Recording what every torch.distributed call of this process posts and waits on (the rules it is checked against:
nccl_rules/__init__.py)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import is_fake

P2P_FUNCTIONS = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "reduce_scatter", "broadcast", "barrier", "reduce", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


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
    """The first frame outside torch and this file: the code that communicated."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and "/nccl_rules/" not in path:
            return f"{'/'.join(path.rsplit('/', 2)[-2:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _RecordedWork:
    """A Work whose wait() is recorded; receive digests are taken once the data is there."""

    def __init__(self, work: Any, recorder: CommRecorder, call: Call, received: list[tuple[Message, torch.Tensor]]):
        self._work, self._recorder, self._call, self._received = work, recorder, call, received

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs) if self._work is not None else True
        self._recorder.waited(self._call)
        for message, buffer in self._received:
            message.digest = _digest(buffer)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommRecorder:
    """While active, records every torch.distributed call this process makes (not thread-safe
    across ranks: one recorder per process)."""

    def __init__(self, rank: int) -> None:
        self.record = RankRecord(rank)
        self._posted = 0  # calls posted so far: the next call's index
        self._waited: set[int] = set()
        self._depth = threading.local()
        self._saved: dict[tuple[Any, str], Callable] = {}

    def __enter__(self) -> CommRecorder:
        for name in ("batch_isend_irecv", *P2P_FUNCTIONS, *COLLECTIVES):
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved[(module, name)] = original
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (module, name), original in self._saved.items():
            setattr(module, name, original)

    def waited(self, call: Call) -> None:
        if call.index not in self._waited:
            self._waited.add(call.index)
            self.record.events.append(("wait", call.index))

    def _wrap(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._depth, "value", 0):  # torch calling its own functions: one call
                return original(*args, **kwargs)
            self._depth.value = 1
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                return self._post(name, original, bound)
            finally:
                self._depth.value = 0

        return wrapper

    def _batch(self, original: Callable, ops: list[dist.P2POp]) -> list:
        """torch tells sends from receives by identity with its own isend: hand it the originals."""
        originals = {name: self._saved[(c10d, name)] for name in ("isend", "irecv")}
        for op in ops:
            op.op = originals[op.op.__name__]
        try:
            for name, function in originals.items():
                setattr(c10d, name, function)
            return original(ops)
        finally:
            for name in originals:
                setattr(c10d, name, getattr(dist, name))

    def _post(self, name: str, original: Callable, bound: inspect.BoundArguments) -> Any:
        a = bound.arguments
        if name == "batch_isend_irecv":
            group = a["p2p_op_list"][0].group
            ops = [(op.op.__name__ == "isend", op.peer, op.tensor) for op in a["p2p_op_list"]]
        elif name in P2P_FUNCTIONS:
            group = a.get("group")
            peer = a.get("dst", a.get("src"))
            peer = peer if peer is not None else dist.get_global_rank(group, a.get("group_dst", a.get("group_src")))
            ops = [(name.endswith("send"), peer, a["tensor"])]
        else:
            group, ops = a.get("group"), []
        group = group if group is not None else c10d._get_default_group()
        call = Call(self.record.rank, self._posted, name, group.group_name,
                    tuple(dist.get_process_group_ranks(group)), where=_caller(), desc=group.group_desc)
        received = []
        for send, peer, tensor in ops:
            message = Message(send, peer, tensor.numel() * tensor.element_size(), str(tensor.dtype))
            if send:
                message.digest = _digest(tensor)
            else:
                received.append((message, tensor))
            call.messages.append(message)
        if name == "all_to_all_single":  # uneven splits: members agree pairwise, not on one size
            call.dtype, call.splits = str(a["input"].dtype), _all_to_all_splits(a, len(call.members))
        elif not ops:
            tensor = _collective_tensor(name, a)
            if tensor is not None:
                call.nbytes, call.dtype = tensor.numel() * tensor.element_size(), str(tensor.dtype)
        call.payload = _payload(call, a)
        self.record.events.append(("post", call))
        self._posted += 1
        if name == "batch_isend_irecv":
            result = self._batch(original, a["p2p_op_list"])
        else:
            result = original(*bound.args, **bound.kwargs)
        if name == "batch_isend_irecv":
            works = [_RecordedWork(w, self, call, [r for r in received if r[1] is op.tensor])
                     for w, op in zip(result, a["p2p_op_list"])]
            return works
        if isinstance(result, dist.Work):
            return _RecordedWork(result, self, call, received)
        _RecordedWork(None, self, call, received).wait()  # a blocking call: posted, then waited
        return result


def _all_to_all_splits(arguments: dict[str, Any], members: int) -> tuple[list[int], list[int]]:
    """Bytes an all_to_all_single sends to and receives from each member, in group order (even splits when
    none are given)."""
    def per_member(tensor: torch.Tensor, sizes: list[int] | None) -> list[int]:
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() and len(tensor) else 0
        rows = sizes if sizes else [len(tensor) // members] * members
        return [n * row for n in rows]

    return (per_member(arguments["input"], arguments.get("input_split_sizes")),
            per_member(arguments["output"], arguments.get("output_split_sizes")))


def _payload(call: Call, arguments: dict[str, Any]) -> int:
    """Sends: their bytes; an all-to-all: the rows it sends; a collective: its largest tensor (the whole
    gathered or reduce-scattered buffer, NCCL's tests' size)."""
    if call.messages:
        return sum(m.nbytes for m in call.messages if m.send)
    if call.splits is not None:
        return sum(call.splits[0])
    tensors = [v for v in arguments.values() if isinstance(v, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


def _collective_tensor(name: str, arguments: dict[str, Any]) -> torch.Tensor | None:
    """The tensor whose size every member of a collective must agree on."""
    for key in ("tensor", "input_tensor", "input"):
        value = arguments.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None
