"""One simulated rank of a world of any size, in this process: torch's fake process group and fake tensors.

torch ships a fake process group for testing (FakeProcessGroup): every collective and point-to-point call
returns at once and moves no data, so one process can stand for rank r of 16,384 and build every group that
rank joins; its groups are observed ones (parallel/observed.py), whose calls the NCCL-rule recorder records, and
they skip the copies torch's fake group makes to fill a collective's output (nothing to fill in a fake tensor).
Fake tensors (torch._subclasses.FakeTensorMode) carry shapes, dtypes and storage sizes but allocate nothing,
so the real model, buffers and optimizer of a 405B-parameter layout fit here. The device stays the CPU: the
CPU code paths run (autocast, attention kernels), which CUDA cannot be made to on a machine without one. Where
megalite picks a setting by device type for speed alone (the head's cross-entropy chunk: a few cached rows on
CPUs, ~1 GiB on accelerators), the dry run gives the built model the accelerator's (`as_accelerator`): it
stands for a GPU, and a CPU's chunking would multiply its operations a thousandfold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from megalite.dryrun.live_bytes import LiveBytes
from megalite.model.cross_entropy import ACCELERATOR_CHUNK_BYTES
from megalite.model.head import LMHead
from megalite.parallel import observed


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process is rank `rank` of `world_size` on the fake backend (CPU and meta tensors) inside the block.
    Its groups are destroyed without release_process_groups' garbage collection: fake groups run no worker
    threads to join, and a full collection costs a large process a second, once per simulated rank."""
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group: it builds the fake one itself")
    dist.init_process_group(observed.FAKE, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _CountingFakeTensorMode(FakeTensorMode):
    """Fake tensors whose every operation's outputs are counted by a LiveBytes (`live.observe`), in the fake mode's
    own dispatch: a LiveBytes mode stacked above it would cost every call a second Python dispatch, and more than
    half the calls of a step are the device queries torch makes of fake tensors (a fifth of a step's time, with
    nothing to count). Only the calls a mode above would see are counted, not those the fake mode makes through
    itself to run one (decompositions), hence the depth."""

    def __init__(self, live: LiveBytes) -> None:
        super().__init__()
        self.live, self.depth = live, 0

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.depth += 1
        try:
            out = super().dispatch(func, types, args, kwargs or {})
        finally:
            self.depth -= 1
        if self.depth == 0:
            self.live.observe(func, args, out)
        return out


@contextlib.contextmanager
def fake_tensors(live: LiveBytes | None = None) -> Iterator[FakeTensorMode]:
    """Every tensor made inside the block is fake: shapes and sizes, no memory, no values to read. With `live`,
    every storage is counted there as `live.counting()` counts it (what autograd saves as activations)."""
    if live is None:
        with FakeTensorMode() as mode:
            yield mode
        return
    with _CountingFakeTensorMode(live) as mode, live.counting_saved():
        yield mode


def as_accelerator(model: nn.Module) -> None:
    """`model`, built on the CPU, takes the accelerators' speed settings (the head's cross-entropy chunk)."""
    for module in model.modules():
        if isinstance(module, LMHead):
            module.loss_chunk_bytes = ACCELERATOR_CHUNK_BYTES
