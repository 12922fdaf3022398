"""ZeRO stages 0-2 over one bucket layout: how gradients are stored and reduced, and parameters shared.

One class per stage, each the stage below it plus what that stage shards (DeepSpeed's numbering; in
Megatron-FSDP's words stage 1 is `optim`, 2 `optim_grads`, 3 `optim_grads_params`, zero/stage3.py):
- 0 (`AllReduce`): one full gradient buffer, all-reduced once per step;
- 1 (`ReduceScatter`): the same buffer, reduce-scattered: each rank keeps the reduced slice its optimizer
  owns; parameters live in one flat buffer of the layout, all-gathered bucket by bucket after the step;
- 2 (`ShardedGradients`): no full-size gradient buffer between micro batches. A bucket's gradients
  accumulate in a buffer of the bucket's size, reduce-scattered every micro batch once they are all in;
  this rank's slice is added into `shard_data` (the owned slices of every bucket, 1/replicas of the
  layout). A collective keeps its input alive until it is waited for, so reductions must land, not pile
  up: at most MAX_IN_FLIGHT are in flight at once (launching another lands the oldest), and a bucket's
  previous one always lands before its next buffer is made. Leaving them in flight until the end of the
  step (as before issue 25) held one full-size buffer per micro batch, more than stage 1's one.

Under train.fp8_param_gather the FP8 weights' buckets (bucket_layout.py) are gathered as FP8 bytes instead
(parallel/fp8/param_gather.py), into a copy the matmuls read; a strategy is handed those weights' recipes.

Every strategy has the same few methods; the gradient buffer (grad_buffer.py) decides when a bucket is
complete and calls them. A reduction in flight keeps its input referenced until it lands, so what it holds
is visible and counted (`InFlight`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.bucket_layout import Bucket, BucketLayout
from megalite.parallel.fp8.param_gather import Float8Gathers
from megalite.parallel.fp8.recipes import Float8
from megalite.parallel.mappings import all_gather_single, reduce_scatter_single
from megalite.parallel.timing import Mark, mark

MAX_IN_FLIGHT = 2  # stages 2-3: bucket reductions in flight at once (each holds its bucket's buffer)


class InFlight(NamedTuple):
    """A bucket's reduction that has not landed: its work (None: nothing to wait for), input and output."""

    work: dist.Work | None
    input: torch.Tensor
    output: torch.Tensor


class AllReduce:
    """Stage 0: every replica keeps whole gradients and parameters."""

    every_micro_batch = False  # reduce in the last micro batch only (1, 0) or every one (2, 3)
    sharded_optimizer = False  # the optimizer steps only this rank's shard of each bucket
    gathers_after_step = False  # updated parameters are all-gathered after the step (1, 2)

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None, rank: int,
                 params: list[nn.Parameter], grad_dtype: torch.dtype, fp8: dict[int, Float8] | None = None) -> None:
        """`fp8`: the recipes of the weights gathered in FP8, by parameter id (stages 1-3)."""
        self.layout, self.group, self.rank, self.replicas = layout, group, rank, layout.replicas
        self.device, self.grad_dtype = params[0].device, grad_dtype
        self.float8: Float8Gathers | None = None
        self.in_flight: dict[int, InFlight] = {}
        self.allocation_observers: list[Callable[[torch.Tensor], None]] = []
        self.grad_data: torch.Tensor | None = None
        self.shard_data: torch.Tensor | None = None
        self.param_data: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self._make_grad_storage(params)

    def _make_grad_storage(self, params: list[nn.Parameter]) -> None:
        self.grad_data = self._zeros(self.layout.size)
        for param in params:
            param.main_grad = self._view(self.grad_data, param)

    def _zeros(self, size: int) -> torch.Tensor:
        """Every gradient buffer a strategy makes: one place, which tells the allocation observers
        (`observe_allocations`)."""
        tensor = torch.zeros(size, dtype=self.grad_dtype, device=self.device)
        for observer in self.allocation_observers:
            observer(tensor)
        return tensor

    def observe_allocations(self, observer: Callable[[torch.Tensor], None]) -> None:
        """Tell `observer` of each gradient buffer made from now on (planning/measure.py GradientBytes counts them;
        what was made at build is `grad_data` or `shard_data`). Parameter storage is not gradient storage."""
        self.allocation_observers.append(observer)

    def _param_storage(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer for parameters (stages 1-3), not counted as gradient storage."""
        return torch.zeros(size, dtype=dtype, device=self.device)

    def _view(self, flat: torch.Tensor, param: nn.Parameter, first: int = 0) -> torch.Tensor:
        """`param`'s elements of a flat buffer of the layout that starts at layout element `first`."""
        start, end = self.layout.offsets[id(param)]
        return flat[start - first:end - first].view_as(param)

    def grads(self, bucket: Bucket) -> torch.Tensor:
        """Where the bucket's gradients accumulate now (its parameters' main_grad point there)."""
        return self.grad_data[bucket.start:bucket.end]

    def pending_launch(self, bucket: Bucket) -> bool:
        """Whether the bucket has gradients not yet handed to a reduction this step."""
        return bucket.index not in self.in_flight

    def launch(self, bucket: Bucket) -> None:
        if self.replicas > 1:
            data = self.grads(bucket)
            self.in_flight[bucket.index] = InFlight(dist.all_reduce(data, group=self.group, async_op=True), data, data)

    def land(self, bucket: Bucket) -> list[tuple[Mark, Mark]]:
        """Wait for the bucket's reduction in flight and put this rank's result in place; returns the wait as
        (start, end) marks on the device's timeline (timing.py)."""
        flight = self.in_flight.pop(bucket.index, None)
        if flight is None:
            return []
        waits = []
        if flight.work is not None:
            begin = mark(self.device)
            flight.work.wait()
            waits.append((begin, mark(self.device)))
        return waits

    def wait(self) -> None:
        """Wait for every reduction in flight and drop it (closing after an interrupted step)."""
        for flight in self.in_flight.values():
            if flight.work is not None:
                flight.work.wait()
        self.in_flight.clear()

    def zero(self) -> None:
        self.grad_data.zero_()

    def owned_grad(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of elements [lo, hi) of `param`, a range this rank owns."""
        return param.main_grad.view(-1)[lo:hi]

    def owned_weights(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """Where elements [lo, hi) of `param` (an owned range) are stored: what the optimizer updates."""
        return param.data.view(-1)[lo:hi]

    def gather_params(self, bucket: Bucket) -> dist.Work | None:
        """Start sharing this rank's updated slice of the bucket's parameters (stages 1 and 2)."""
        return None


class ReduceScatter(AllReduce):
    """Stage 1: gradients reduce-scattered, parameters in one flat buffer all-gathered after the step."""

    sharded_optimizer = True
    gathers_after_step = True
    keeps_whole_params = True  # between uses (not ZeRO-3)

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None, rank: int,
                 params: list[nn.Parameter], grad_dtype: torch.dtype, fp8: dict[int, Float8] | None = None) -> None:
        super().__init__(layout, group, rank, params, grad_dtype)
        self._store_params(params)
        if fp8:
            self.float8 = Float8Gathers(layout, group, rank, fp8, self.device, self.keeps_whole_params)
            for bucket in (b for b in layout.buckets if b.fp8):  # the initial weights' FP8 copies
                work = self._gather_fp8(bucket)
                if work is not None:
                    work.wait()

    def _gather_fp8(self, bucket: Bucket) -> dist.Work | None:
        """Quantise this rank's slice of an FP8 bucket, and share it now (stages 1-2) or at each use (3)."""
        self.float8.quantize(bucket, self.owned_weights)
        if not self.keeps_whole_params:
            return None
        return self.float8.gather(bucket)

    def _store_params(self, params: list[nn.Parameter]) -> None:
        """Parameters become views of one flat buffer of the layout, keeping their values."""
        self.param_data = self._param_storage(self.layout.size, params[0].dtype)
        for param in params:
            view = self._view(self.param_data, param)
            view.copy_(param.data)
            param.data = view

    def launch(self, bucket: Bucket) -> None:
        """Reduce-scatter the bucket in place, as Megatron-LM does: this rank's slice of the bucket is the output
        (NCCL's in-place form, the output at rank x its size in the input), so no buffer of its own is held
        while the reduction is in flight (a separate output per bucket held grads/dp beside the activations of
        the chunks still running backward: found by the dry run). The other slices are left undefined."""
        if self.replicas > 1:
            data = self.grads(bucket)
            a, b = bucket.shard(self.rank, self.replicas)
            mine = self.grad_data[a:b]
            self.in_flight[bucket.index] = InFlight(reduce_scatter_single(mine, data, self.group, async_op=True),
                                                    data, mine)

    def gather_params(self, bucket: Bucket) -> dist.Work | None:
        if bucket.fp8:
            return self._gather_fp8(bucket)
        if self.replicas == 1:
            return None
        a, b = bucket.shard(self.rank, self.replicas)
        shard = self.param_data[a:b].clone()
        return all_gather_single(self.param_data[bucket.start:bucket.end], shard, self.group, async_op=True)


class ShardedGradients(ReduceScatter):
    """Stage 2: only this rank's reduced slices are kept; each bucket has a buffer only while it fills."""

    every_micro_batch = True

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None, rank: int,
                 params: list[nn.Parameter], grad_dtype: torch.dtype, fp8: dict[int, Float8] | None = None) -> None:
        self.filling: dict[int, torch.Tensor] = {}  # bucket index -> the buffer its gradients accumulate in
        super().__init__(layout, group, rank, params, grad_dtype, fp8)

    def _make_grad_storage(self, params: list[nn.Parameter]) -> None:
        self.shard_data = self._zeros(self.layout.size // self.replicas)
        for param in params:
            param.main_grad = None

    def grads(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's buffer for this micro batch, made on its first gradient, once the bucket's previous
        reduction has landed (so that its input is freed first)."""
        if bucket.index not in self.filling:
            self.land(bucket)
            data = self.filling[bucket.index] = self._zeros(bucket.end - bucket.start)
            for param in bucket.params:
                param.main_grad = self._view(data, param, bucket.start)
        return self.filling[bucket.index]

    def pending_launch(self, bucket: Bucket) -> bool:
        return bucket.index in self.filling

    def launch(self, bucket: Bucket) -> None:
        """Reduce-scatter the bucket straight into this rank's slice of `shard_data`: the slice's sum so far is
        first added into this rank's part of the input (no other rank adds there), so the reduced slice is
        the new total, with no output buffer or addition of its own."""
        data = self.filling.pop(bucket.index)
        for param in bucket.params:
            param.main_grad = None
        mine = self.shard_data[self.layout.bucket_shard(bucket)]
        if self.replicas == 1:
            mine.add_(data)
            return
        a, b = bucket.shard(self.rank, self.replicas)
        data[a - bucket.start:b - bucket.start].add_(mine)
        work = reduce_scatter_single(mine, data, self.group, async_op=True)
        self.in_flight[bucket.index] = InFlight(work, data, mine)
        while len(self.in_flight) > MAX_IN_FLIGHT:  # the oldest lands: its buffer is freed
            self.land(self.layout.buckets[next(iter(self.in_flight))])

    def zero(self) -> None:
        self.shard_data.zero_()

    def owned_grad(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        first = self.layout.shard_position(param, lo, self.rank)
        return self.shard_data[first:first + hi - lo]
