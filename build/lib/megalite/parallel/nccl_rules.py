"""Record the communication that gloo ranks really perform, then replay it under NCCL's rules.

gloo forgives what NCCL does not: a gloo send never blocks another rank's call, and tags
route messages. NCCL (user guide, "Point-to-point communication"; ncclSend/ncclRecv) runs
every call on a GPU stream:

- a send or receive blocks its stream until the peer's matching call runs; only the calls
  of one group (one `batch_isend_irecv`) progress together;
- messages match in the order they were posted per communicator and direction; tags are
  ignored;
- calls on one stream run in the order they were posted; a batch and every collective use
  the process group's communicator and stream; a single `isend`/`irecv` uses a two-rank
  communicator of its own ("pair" placement), or the group's one when the group was bound
  to a device ("group" placement); both are replayed;
- every call waits for the compute queued before it, which waits for every call already
  waited on (`work.wait()` does not block the host; it orders the compute stream).

`CommRecorder` wraps torch.distributed's functions inside one process and records, in
order, each call it posts (communicator, peers, sizes, a digest of the bytes sent or
received) and each wait on it. `replay` runs all ranks' records as NCCL would and reports
every call that could never finish (a hang), every message NCCL would deliver to another
receive than gloo did (a silent swap), and every size or collective mismatch.

It lives in megalite, not only in the tests, because the dry run (megalite/dryrun/) records the calls of
ranks it simulates on fake tensors (no bytes to digest: sizes and order are checked, not contents).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import threading
from collections import defaultdict
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
PLACEMENTS = ("pair", "group")


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
        if "/torch/" not in path and not path.endswith("nccl_rules.py"):
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


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    calls: int = 0
    messages: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        return "\n".join(self.problems[:40])


class _Replay:
    """One placement's replay: streams, message channels and the started/completed fixpoint."""

    def __init__(self, records: dict[int, RankRecord], placement: str) -> None:
        self.placement, self.report = placement, Report()
        self.calls = {(r, c.index): c for r, rec in records.items() for c in rec.calls}
        self.report.calls = len(self.calls)
        self.streams: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        self.waits: dict[int, list[int]] = {r: [i for kind, i in rec.events if kind == "wait"]
                                            for r, rec in records.items()}
        self.waits_before: dict[tuple[int, int], int] = {}
        for r, rec in records.items():
            waited = 0
            for kind, item in rec.events:
                if kind == "wait":
                    waited += 1
                else:
                    self.waits_before[(r, item.index)] = waited
                    self.streams[(r, self._communicator(item))].append((r, item.index))
        self.partners = self._match()

    def _communicator(self, call: Call, peer: int | None = None) -> tuple:
        if call.single and self.placement == "pair":
            peer = call.messages[0].peer if peer is None else peer
            return ("pair", call.comm, min(call.rank, peer), max(call.rank, peer))
        return ("group", call.comm)

    def _match(self) -> dict[tuple[int, int], set[tuple[int, int]]]:
        """Pair sends with receives in post order per communicator and direction, collectives in post
        order per communicator; note every mismatch. Returns each call's partner calls."""
        sends, recvs, collectives = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(list))
        for key in sorted(self.calls):
            call = self.calls[key]
            for message in call.messages:
                src, dst = (call.rank, message.peer) if message.send else (message.peer, call.rank)
                channel = (self._communicator(call, message.peer), src, dst)
                (sends if message.send else recvs)[channel].append((key, message))
            if not call.messages:
                collectives[call.comm][call.rank].append(key)
        partners: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
        for channel in sends.keys() | recvs.keys():
            self._pair_messages(channel, sends[channel], recvs[channel], partners)
        for comm, per_rank in collectives.items():
            self._pair_collectives(comm, per_rank, partners)
        return partners

    def _pair_messages(self, channel: tuple, sent: list, received: list, partners: dict) -> None:
        _, src, dst = channel
        self.report.messages += min(len(sent), len(received))
        for (skey, s), (rkey, r) in zip(sent, received):
            partners[skey].add(rkey)
            partners[rkey].add(skey)
            if s.nbytes != r.nbytes or s.dtype != r.dtype:
                self._problem(f"size mismatch: {self.calls[skey].describe()} sends {s.nbytes} bytes {s.dtype} "
                              f"into {self.calls[rkey].describe()} which expects {r.nbytes} bytes {r.dtype}")
            elif r.digest is not None and s.digest != r.digest:
                self._problem(f"wrong message: NCCL matches {self.calls[skey].describe()} with "
                              f"{self.calls[rkey].describe()}, but that receive got other data under gloo "
                              "(messages between two ranks must be received in the order they are sent; "
                              "tags are ignored)")
        for key, _ in sent[len(received):]:
            self._problem(f"send {src}->{dst} never received: {self.calls[key].describe()}")
        for key, _ in received[len(sent):]:
            self._problem(f"receive {src}->{dst} never sent: {self.calls[key].describe()}")

    def _pair_collectives(self, comm: str, per_rank: dict[int, list], partners: dict) -> None:
        members = self.calls[next(iter(per_rank.values()))[0]].members
        counts = {r: len(per_rank.get(r, [])) for r in members}
        if len(set(counts.values())) > 1:
            self._problem(f"group {comm}: members post different numbers of collectives {counts}")
        for position in range(min(counts.values())):
            keys = [per_rank[r][position] for r in members]
            shapes = {(self.calls[k].name, self.calls[k].nbytes, self.calls[k].dtype) for k in keys}
            if len(shapes) > 1:
                self._problem(f"group {comm}: collective #{position} differs across members: "
                              + "; ".join(self.calls[k].describe() for k in keys))
            if all(self.calls[k].splits is not None for k in keys):
                self._pair_all_to_all([self.calls[k] for k in keys])
            for key in keys:
                partners[key].update(k for k in keys if k != key)

    def _pair_all_to_all(self, calls: list[Call]) -> None:
        """Member i's bytes to member j are what j expects from i."""
        for i, sender in enumerate(calls):
            for j, receiver in enumerate(calls):
                if sender.splits[0][j] != receiver.splits[1][i]:
                    self._problem(f"all-to-all size mismatch: {sender.describe()} sends {sender.splits[0][j]} bytes "
                                  f"to {receiver.describe()}, which expects {receiver.splits[1][i]}")

    def _problem(self, text: str) -> None:
        self.report.problems.append(f"[{self.placement} placement] {text}")

    def run(self) -> Report:
        started, done = set(), set()
        heads = {stream: 0 for stream in self.streams}
        self.waited_done = waited_done = dict.fromkeys(self.waits, 0)
        progress = True
        while progress:
            progress = False
            for stream, queue in self.streams.items():
                while heads[stream] < len(queue):
                    key = queue[heads[stream]]
                    if key not in started and waited_done[key[0]] >= self.waits_before[key]:
                        started.add(key)
                        progress = True
                    if key not in started or not self.partners[key] <= started:
                        break
                    done.add(key)
                    heads[stream] += 1
                    progress = True
            for rank, waits in self.waits.items():
                while waited_done[rank] < len(waits) and (rank, waits[waited_done[rank]]) in done:
                    waited_done[rank] += 1
        self._report_hang(started, done, heads)
        return self.report

    def _report_hang(self, started: set, done: set, heads: dict) -> None:
        for stream, queue in self.streams.items():
            if heads[stream] >= len(queue):
                continue
            key = queue[heads[stream]]
            call = self.calls[key]
            if key in started:
                missing = sorted(self.partners[key] - started)
                why = "its peers' matching calls never start: " + "; ".join(self.calls[k].describe() for k in missing)
            else:
                blocker = self.calls[(key[0], self.waits[key[0]][self.waited_done[key[0]]])]
                why = f"it waits for compute that waits for {blocker.describe()}"
            self._problem(f"hang: {call.describe()} never completes: {why}")


def replay(records: dict[int, RankRecord] | list[RankRecord], placements: tuple[str, ...] = PLACEMENTS) -> Report:
    """Replay every rank's record under NCCL's rules for each communicator placement."""
    if isinstance(records, list):
        records = {record.rank: record for record in records}
    total = Report()
    for placement in placements:
        report = _Replay(records, placement).run()
        total.problems += report.problems
        total.calls, total.messages = report.calls, max(total.messages, report.messages)
    return total
