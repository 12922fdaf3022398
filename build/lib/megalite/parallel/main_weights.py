"""The fp32 tensors the optimizer steps ("main weights"), each in the one home chosen at construction:

- in place: an fp32 parameter's owned range is stepped where the parameter (or its ZeRO-3 shard) is stored;
- a device copy: bf16/fp16 parameters get an fp32 copy, written back (rounded) after each step, so small
  updates are not lost to rounding (Megatron-LM's --bf16);
- a host copy (`optim.offload=cpu`, ZeRO-Offload, Megatron-LM's --optimizer-cpu-offload): fp32 copies in
  host memory, stepped there by torch's fused CPU AdamW. Each bucket set's main weights are one flat host
  buffer, and its gradients another (pinned on GPUs, so copies overlap; one pinned block per parameter
  would be rounded up to a power of two each by the caching host allocator). A bucket's reduced gradient
  slices start their copy to the host as soon as its reduction has landed, while later buckets' are still
  landing; after the update each bucket's weights go back just before that bucket's parameter
  all-gather. All copies are non-blocking, with one synchronisation before the update.

The host update runs on this rank's share of the node's cores (`host_step_threads`), not on the one
thread torchrun's OMP_NUM_THREADS=1 leaves each rank. The count is set around the update only
(`on_host`), not once for the process: on a CPU device the model's own threads must stay as chosen,
and a GPU rank's other host work (kernel launches, batches) gains nothing from more threads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megalite.parallel.bucket_layout import Bucket
from megalite.parallel.topology import synchronize


@dataclass
class MainParam:
    """Elements [start, end) of `param` (flattened), stepped as the flat fp32 tensor `main` with the gradient
    view `grad`; `weights` is where those elements are stored (a view of the parameter, or under ZeRO-3 of
    this rank's parameter shard). `is_copy`: `main` is a copy to write back into the weights; `host_grad`:
    where an offloaded gradient is copied to."""

    name: str
    param: nn.Parameter
    main: torch.Tensor
    grad: torch.Tensor
    weights: torch.Tensor
    start: int
    end: int
    bucket: Bucket
    is_copy: bool
    host_grad: torch.Tensor | None = None


@dataclass(frozen=True)
class Owned:
    """One range this rank's optimizer owns: its parameter, where its elements are stored and reduced."""

    name: str
    param: nn.Parameter
    weights: torch.Tensor  # flat
    grad: torch.Tensor  # flat
    start: int
    end: int
    bucket: Bucket


def host_step_threads() -> int:
    """Threads for an offloaded optimizer update: the cores this process may run on (its affinity, else the
    machine's), shared by the node's LOCAL_WORLD_SIZE ranks, at least one. Under torchrun (and `srun
    torchrun`) every local rank inherits the launcher's affinity, so each gets an equal share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _host(size: int, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=torch.float32, pin_memory=device.type == "cuda")


class MainWeights:
    """`owned`: each bucket set's owned ranges (one list per gradient buffer); `offload`: keep them on the
    host."""

    def __init__(self, owned: list[list[Owned]], device: torch.device, offload: bool) -> None:
        self.device, self.offload = device, offload
        self.host_threads = host_step_threads() if offload else None
        self.params: list[MainParam] = []
        self._host_grads: list[torch.Tensor] = []
        for ranges in owned:
            if offload:
                size = sum(o.end - o.start for o in ranges)
                weights, grads = _host(size, device), _host(size, device)
                self._host_grads.append(grads)
                offset = 0
                for o in ranges:
                    main, end = weights[offset:offset + o.end - o.start], offset + o.end - o.start
                    main.copy_(o.weights)
                    self._add(o, nn.Parameter(main, requires_grad=False), True, grads[offset:end])
                    offset = end
            else:
                for o in ranges:
                    copy = o.param.dtype != torch.float32
                    main = o.weights.float() if copy else o.weights
                    self._add(o, nn.Parameter(main, requires_grad=False), copy)

    def _add(self, o: Owned, main: torch.Tensor, is_copy: bool, host_grad: torch.Tensor | None = None) -> None:
        self.params.append(MainParam(o.name, o.param, main, o.grad, o.weights, o.start, o.end, o.bucket, is_copy,
                                     host_grad))

    def host_grads(self) -> list[torch.Tensor]:
        """The host buffers offloaded gradients are copied into (none without offload)."""
        return self._host_grads

    def on_host(self) -> contextlib.AbstractContextManager:
        """Around the update's work on the main weights: offloaded, it runs on `host_threads` threads."""
        return _threads(self.host_threads) if self.host_threads else contextlib.nullcontext()

    def grads_landed(self, bucket: Bucket) -> None:
        """The bucket's reduced gradients are final: offloaded, start their copies to the host now
        (non-blocking, so they queue behind the reduction)."""
        for m in self.params if self.offload else []:
            if m.bucket is bucket:
                self._grad_to_host(m)

    def _grad_to_host(self, m: MainParam) -> None:
        m.main.grad = m.host_grad.copy_(m.grad, non_blocking=True)

    def collect_grads(self) -> None:
        """Point each main tensor at its (reduced) gradient, in fp32: on the host when offloaded (copies
        `grads_landed` has not started yet are started here, then one synchronisation)."""
        if self.offload:
            for m in self.params:
                if m.main.grad is None:
                    self._grad_to_host(m)
            synchronize(self.device)
            return
        for m in self.params:
            m.main.grad = m.grad if m.grad.dtype == m.main.dtype else m.grad.to(m.main.dtype)

    def write_back(self, bucket: Bucket | None = None) -> None:
        """Copy the updated main weights into the stored weights: device copies all at once (`bucket` None),
        host copies bucket by bucket (non-blocking, before that bucket's gather)."""
        if bucket is None and not self.offload:
            copies = [m for m in self.params if m.is_copy]
            if copies:
                torch._foreach_copy_([m.weights for m in copies], [m.main for m in copies])
        elif bucket is not None and self.offload:
            for m in self.params:
                if m.bucket is bucket:
                    m.weights.copy_(m.main, non_blocking=True)
