"""Observed process groups: the seam through which a verifier or a meter sees every communication call.

torch.distributed lets a package register a backend of its own (`Backend.register_backend`). The backends here
run every call on gloo (`observed_gloo`) or on torch's fake process group (`observed_fake`, the dry run; minus
the copies it makes to fill outputs, `_DataFree`) and
tell the observers registered in this process (`observing`) about each call a group posts, before and after
it runs, and about each wait on it. With none registered a call costs one list check. The NCCL-rule recorder
(dryrun/nccl_rules/record.py) and the tensor-parallel benchmark's communication meter are observers; the tools
and tests that spawn ranks (parallel/spawn.py) and the dry run create their groups with these backends.

A call is one operation of a group (`allreduce`, `send`, `all_to_all_single`, ...), with the arguments torch
hands a process group: what torch's functions built from theirs (group ranks, lists of tensors, options).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import CodeType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

GLOO, FAKE = "observed_gloo", "observed_fake"
# A group's operations (the names torch's functions call on a process group) and the name each has on the
# backend that runs it.
OPERATIONS = {"allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "broadcast": "broadcast",
              "reduce": "reduce", "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
              "all_gather_single": "_allgather_base", "reduce_scatter": "reduce_scatter",
              "reduce_scatter_single": "_reduce_scatter_base", "all_to_all_single": "alltoall_base",
              "alltoall": "alltoall", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
              "send": "send", "recv": "recv", "recv_anysource": "recv_anysource"}


@dataclass(eq=False)
class GroupCall:
    """One operation a group posted: `arguments` as torch handed them to the group."""

    group: ObservedGroup
    operation: str
    arguments: tuple
    keywords: dict[str, Any]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor among the arguments, lists flattened, in order."""
        return _tensors_in((self.arguments, tuple(self.keywords.values())))


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, lists and tuples flattened, in order. A module-level function, not a closure
    that calls itself: such a closure is a reference cycle (function -> cell -> function) holding its list of
    tensors, which only the cyclic garbage collector frees: every communicated buffer would outlive its call."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    return []


class CommObserver:
    """Told about each call of every observed group in this process; override what you need."""

    def posting(self, call: GroupCall) -> None:
        """Before the backend runs the call."""

    def posted(self, call: GroupCall) -> None:
        """The backend returned: the call is in flight (a blocking function waits on it next)."""

    def waiting(self, call: GroupCall) -> None:
        """Someone waits on the call (told also after the observer's block, for a call posted inside it)."""

    def waited(self, call: GroupCall) -> None:
        """That wait returned: the call's data is there."""


_observers: list[CommObserver] = []
BATCHES: set[CodeType] = set()  # megalite's functions that post one batch (one_batch)
Function = TypeVar("Function", bound=Callable)


def one_batch(function: Function) -> Function:
    """Marks `function` as posting one batch of sends and receives, as torch's `batch_isend_irecv` does (under
    NCCL: one ncclGroupStart/End): an observer that groups a group's operations into calls (the NCCL-rule
    recorder) takes what it posts as one call."""
    BATCHES.add(function.__code__)
    return function


@contextlib.contextmanager
def observing(observer: CommObserver) -> Iterator[CommObserver]:
    """`observer` is told about every call of the observed groups in this process inside the block."""
    _observers.append(observer)
    try:
        yield observer
    finally:
        _observers.remove(observer)


def _tell(observers: list[CommObserver], event: str, call: GroupCall) -> None:
    for observer in observers:
        getattr(observer, event)(call)


class _ObservedWork(dist.Work):
    """The backend's work; waits on it are told to the observers that saw it posted."""

    def __init__(self, work: dist.Work, call: GroupCall, observers: list[CommObserver]) -> None:
        super().__init__()
        self._work, self._call, self._observers = work, call, observers

    def wait(self, timeout: timedelta | None = None) -> bool:
        _tell(self._observers, "waiting", self._call)
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        _tell(self._observers, "waited", self._call)
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()

    def _source_rank(self) -> int:
        return self._work._source_rank()


class ObservedGroup(dist.ProcessGroup):
    """A process group that runs its calls on `backend` (a torch backend of the same rank and size) and tells the
    observers about them."""

    def __init__(self, backend: Any, rank: int, size: int, devices: list[str]) -> None:
        super().__init__(rank, size)
        self.backend = self.runner = backend  # the runner runs the calls (the dry run's: _DataFree)
        for device in devices:  # what torch reads a group's device types and default device from
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)

    def getBackendName(self) -> str:  # noqa: N802  (torch's name for it)
        return self.backend.name()

    def _run(self, operation: str, *arguments: Any, **keywords: Any) -> dist.Work:
        run = getattr(self.runner, OPERATIONS[operation])
        if not _observers:
            return run(*arguments, **keywords)
        call, observers = GroupCall(self, operation, arguments, keywords), list(_observers)
        _tell(observers, "posting", call)
        work = run(*arguments, **keywords)
        _tell(observers, "posted", call)
        return _ObservedWork(work, call, observers)

    # The operations torch's functions call on a group (OPERATIONS), each run by _run.
    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("allreduce", *args, **kwargs)

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("allreduce_coalesced", *args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("broadcast", *args, **kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("reduce", *args, **kwargs)

    def allgather(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("allgather", *args, **kwargs)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("allgather_coalesced", *args, **kwargs)

    def all_gather_single(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("all_gather_single", *args, **kwargs)

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("reduce_scatter", *args, **kwargs)

    def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("reduce_scatter_single", *args, **kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("all_to_all_single", *args, **kwargs)

    def alltoall(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("alltoall", *args, **kwargs)

    def gather(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("gather", *args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("scatter", *args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("barrier", *args, **kwargs)

    def send(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("send", *args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("recv", *args, **kwargs)

    def recv_anysource(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._run("recv_anysource", *args, **kwargs)


def _gloo_group(options: Any, backend_options: Any) -> ObservedGroup:
    gloo = ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)
    return ObservedGroup(gloo, options.group_rank, options.group_size, ["cpu"])


class _Done(dist.Work):
    """A call complete when posted, as torch's fake group's are."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _pieces(shape: torch.Size, count: int) -> list[torch.Size]:
    """The shapes of torch.chunk(tensor of `shape`, count) along dim 0."""
    step = -(-shape[0] // count)
    return [torch.Size((min(step, shape[0] - start), *shape[1:])) for start in range(0, shape[0], step)]


def _copyable(source: torch.Size, targets: list[torch.Size], call: str) -> None:
    """What `target.copy_(source)` checks of the shapes, for each target (the source broadcasts to it)."""
    for target in targets:
        if torch.broadcast_shapes(source, target) != target:
            raise RuntimeError(f"{call}: a tensor of shape {list(source)} does not fit {list(target)}")


class _DataFree:
    """torch's fake process group (FakeProcessGroup.hpp) without the copies its all-gather, reduce-scatter and
    all-to-all make to fill their output from their input. On fake tensors there is nothing to fill, and each
    copy is a fake-tensor dispatch: an all-gather over 8 ranks is a chunk and 8 copies, a seventh of the calls
    a llama_70b rank's step dispatches. What those copies would check is checked here (the input fits every
    piece of the output it would be copied into, torch's split-size rules); every other call is the fake group's."""

    def __init__(self, fake: Any, rank: int, size: int) -> None:
        self.fake, self.rank, self.size = fake, rank, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, *_options: Any) -> dist.Work:
        _copyable(input.shape, _pieces(output.shape, self.size), "all_gather_into_tensor")
        return _Done()

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, *_options: Any) -> dist.Work:
        if input.numel() != output.numel() * self.size:
            raise RuntimeError("reduce_scatter_tensor: input tensor must be the same size as output size times world "
                               "size")
        _copyable(_pieces(input.shape, self.size)[self.rank], [output.shape], "reduce_scatter_tensor")
        return _Done()

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], *_options: Any) -> dist.Work:
        for splits, tensor in ((input_splits, input), (output_splits, output)):
            if not splits and tensor.shape[0] % self.size:
                raise RuntimeError("all_to_all_single: Tensor's dim 0 does not divide equally across group size")
            if splits and (len(splits) != self.size or sum(splits) != tensor.shape[0]):
                raise RuntimeError("all_to_all_single: split sizes do not match the group size or dim 0's size")
        if not output_splits and not input_splits:
            _copyable(input.shape, [output.shape], "all_to_all_single")
        elif any(output_splits):  # each output slot is filled from the input's first rows
            if input.shape[0] == 0:
                raise RuntimeError("all_to_all_single: the input is empty but the output expects rows")
            _copyable(torch.Size((1, *input.shape[1:])), [torch.Size((1, *output.shape[1:]))], "all_to_all_single")
        return _Done()


def _fake_group(options: Any, backend_options: Any) -> ObservedGroup:
    from torch._C._distributed_c10d import FakeProcessGroup

    fake = FakeProcessGroup._create_internal(options.group_rank, options.group_size, backend_options)
    group = ObservedGroup(fake, options.group_rank, options.group_size, ["cpu", "meta"])
    group.runner = _DataFree(fake, options.group_rank, options.group_size)
    return group


dist.Backend.register_backend(GLOO, _gloo_group, extended_api=True, devices=["cpu"])
dist.Backend.register_backend(FAKE, _fake_group, extended_api=True, devices=["cpu", "meta"])
