"""Contiguous gradient buffers with bucketed, overlapped data-parallel reduction.

The gradients of one model chunk live in one flat buffer (`param.main_grad` is a view), fp32
by default whatever the parameters' dtype (`parallel.grad_reduce_dtype`),
laid out in reverse order of parameter creation, roughly the order backward produces them,
and cut into buckets of about `bucket_size` elements. A hook after each gradient
accumulation adds the gradient into main_grad; during the last micro batch's backward
(`start_sync`), a bucket whose gradients are all in launches its reduction asynchronously
while backward goes on. Earlier micro batches only accumulate, so a step reduces once.

Reduction sums over data-parallel replicas: every micro batch's loss is already divided
by the token count of the whole global batch (training/step.py), so the sum is the global
mean for any (dp, micro batch) split. With the distributed optimizer, buckets are padded
to a multiple of dp and reduce-scattered: each rank gets the reduced values of its own
slice only, which is all its optimizer shard needs. Parameters then also live in a flat
buffer of the same layout (`param_data`), so the distributed optimizer can all-gather its
updated shards bucket by bucket (distributed_optimizer.py). Under ZeRO-3 (`shard_params`) only
this rank's slices of the parameters live on (`param_shard`); each bucket's whole parameters
have a storage of their own that is gathered and freed around their use (zero3.py), and
buckets never span two of the model's gather units (`units`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.mappings import reduce_scatter_single
from megalite.parallel.timing import Mark, mark


@dataclass
class Bucket:
    start: int
    end: int
    params: list[nn.Parameter]
    pending: set[int] = field(default_factory=set)
    data: torch.Tensor | None = None  # the bucket's gradients (ZeRO-2: only while they accumulate)
    in_flight: list[tuple[dist.Work | None, torch.Tensor]] = field(default_factory=list)  # (work, its result)
    weights: torch.Tensor | None = None  # ZeRO-3: the bucket's whole parameters (storage freed when not in use)

    @property
    def work(self) -> dist.Work | None:
        """The reduction launched last and not yet landed."""
        return self.in_flight[-1][0] if self.in_flight else None

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """This data-parallel rank's slice of the bucket, in buffer coordinates."""
        per = (self.end - self.start) // size
        return self.start + rank * per, self.start + (rank + 1) * per


class GradBuffer:
    """`held` parameters' buckets are not reduced during backward but only in `finish`, after their
    gradients were combined with another stage's (tied embeddings, see ddp.py).

    `shard_grads` (ZeRO-2, with `distributed`): no full-size gradient buffer lives between micro
    batches. A bucket's gradients accumulate in a buffer of the bucket's size, made when its first
    gradient of a micro batch arrives; once all are in it is reduce-scattered, every micro batch,
    and this rank's reduced slice is added into `shard_data` (the owned slices of every bucket, one
    after another), after which the bucket's buffer is dropped. Gradient memory per rank is then
    about 1/dp of the model's plus the buckets in flight, at the price of one reduce-scatter per
    bucket per micro batch instead of per step. Held buckets keep their buffer until `finish`.

    `shard_params` (ZeRO-3, with `shard_grads` and dp > 1): parameters are stored as this rank's slices
    (`param_shard`, laid out as `shard_data`); each bucket's parameters are views of the bucket's own
    `weights`, whose storage is freed at once and gathered by zero3.py when needed. `units` maps each
    parameter to its gather unit (a module of the model): a bucket is also closed where the unit changes,
    so a unit's buckets hold nothing else. `on_grads_in` is told of each bucket whose gradients of one
    backward are all in (ZeRO-3 frees its parameters then)."""

    def __init__(self, params: list[nn.Parameter], bucket_size: int, dp_group: dist.ProcessGroup, dp: int,
                 dp_rank: int, distributed: bool, overlap: bool, held: frozenset[int] = frozenset(),
                 grad_dtype: torch.dtype = torch.float32, shard_grads: bool = False, shard_params: bool = False,
                 units: dict[int, int] | None = None) -> None:
        self.dp_group, self.dp, self.dp_rank, self.distributed, self.overlap = (
            dp_group, dp, dp_rank, distributed, overlap)
        self.shard_grads = shard_grads and distributed
        self.shard_params = shard_params and self.shard_grads and dp > 1
        self.on_grads_in: Callable[[Bucket], None] | None = None
        self.buckets: list[Bucket] = []
        self.offsets: dict[int, tuple[int, int]] = {}
        offset, current = 0, []
        for param in reversed(params):
            if current and units is not None and units[id(param)] != units[id(current[-1])]:
                offset, current = self._close_bucket(current, offset), []
            self.offsets[id(param)] = (offset, offset + param.numel())
            offset += param.numel()
            current.append(param)
            if offset - (self.buckets[-1].end if self.buckets else 0) >= bucket_size:
                offset = self._close_bucket(current, offset)
                current = []
        if current:
            offset = self._close_bucket(current, offset)
        device, self.grad_dtype = params[0].device, grad_dtype
        self.grad_data = None if self.shard_grads else torch.zeros(offset, dtype=grad_dtype, device=device)
        self.shard_data = torch.zeros(offset // dp, dtype=grad_dtype, device=device) if self.shard_grads else None
        self.param_data = torch.zeros(offset, dtype=params[0].dtype, device=device) if distributed else None
        self.param_shard = None
        if self.shard_params:
            self.param_data, self.param_shard = None, torch.zeros(offset // dp, dtype=params[0].dtype, device=device)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.held = {id(b) for b in self.buckets if any(id(p) in held for p in b.params)}
        for param in params:
            start, end = self.offsets[id(param)]
            if self.grad_data is not None:
                param.main_grad = self.grad_data[start:end].view_as(param)
            if distributed:
                self._move_into_storage(param, start, end)
            param.register_post_accumulate_grad_hook(self._on_grad)
        for bucket in self.buckets if self.shard_params else []:
            a, b = bucket.shard(dp_rank, dp)
            self.shard_of(bucket).copy_(bucket.weights[a - bucket.start:b - bucket.start])
            bucket.weights.untyped_storage().resize_(0)
        self.syncing = False

    def _move_into_storage(self, param: nn.Parameter, start: int, end: int) -> None:
        """Make the parameter a view of elements [start, end) of the flat parameter storage (ZeRO-3: of its
        bucket's own storage), keeping its values."""
        if self.shard_params:
            bucket = self.bucket_of[id(param)]
            if bucket.weights is None:
                bucket.weights = torch.zeros(bucket.end - bucket.start, dtype=param.dtype, device=param.device)
            flat, start, end = bucket.weights, start - bucket.start, end - bucket.start
        else:
            flat = self.param_data
        flat[start:end].copy_(param.data.view(-1))
        param.data = flat[start:end].view_as(param)

    def shard_of(self, bucket: Bucket) -> torch.Tensor:
        """ZeRO-3: this rank's slice of the bucket's parameters, the only copy kept between uses."""
        first = bucket.start // self.dp
        return self.param_shard[first:first + (bucket.end - bucket.start) // self.dp]

    def _close_bucket(self, params: list[nn.Parameter], offset: int) -> int:
        start = self.buckets[-1].end if self.buckets else 0
        multiple = self.dp if self.distributed else 1
        end = start + -(-(offset - start) // multiple) * multiple
        self.buckets.append(Bucket(start, end, params))
        return end

    def _bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's gradient storage: a view of the full buffer, or (ZeRO-2) the bucket's own buffer,
        made on first use with every parameter's main_grad pointing into it."""
        if bucket.data is None:
            if self.grad_data is not None:
                bucket.data = self.grad_data[bucket.start:bucket.end]
            else:
                size, device = bucket.end - bucket.start, self.shard_data.device
                bucket.data = torch.zeros(size, dtype=self.grad_dtype, device=device)
                for param in bucket.params:
                    start, end = self.offsets[id(param)]
                    param.main_grad = bucket.data[start - bucket.start:end - bucket.start].view_as(param)
        return bucket.data

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of[id(param)]
        self._bucket_grads(bucket)
        param.main_grad.add_(param.grad)
        param.grad = None
        bucket.pending.discard(id(param))
        if bucket.pending:
            return
        bucket.pending = {id(p) for p in bucket.params}  # for the next backward
        if id(bucket) not in self.held and (self.shard_grads or self.syncing and self.overlap):
            self._launch(bucket)
        if self.on_grads_in is not None:
            self.on_grads_in(bucket)

    def start_sync(self) -> None:
        """The next backward is this chunk's last of the step: reduce buckets as they complete."""
        self.syncing = True

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's reduction: all-reduce in place, or reduce-scatter into a new slice (ZeRO-1/2).
        ZeRO-2 lets go of the bucket's buffer for this micro batch (the collective keeps it alive)."""
        if self.dp == 1 and not self.shard_grads:
            return
        data = self._bucket_grads(bucket)
        if self.shard_grads:
            bucket.data = None
            for param in bucket.params:
                param.main_grad = None
        if self.dp == 1:
            bucket.in_flight.append((None, data))
        elif self.distributed:
            out = torch.empty((bucket.end - bucket.start) // self.dp, dtype=data.dtype, device=data.device)
            bucket.in_flight.append((reduce_scatter_single(out, data, self.dp_group, async_op=True), out))
        else:
            bucket.in_flight.append((dist.all_reduce(data, group=self.dp_group, async_op=True), data))
        if self.shard_grads and not self.overlap:
            self._land(bucket)

    def _land(self, bucket: Bucket) -> list[tuple[Mark, Mark]]:
        """Wait for the bucket's reductions in flight and put this rank's slice in place: added into
        shard_data (ZeRO-2, one per micro batch) or copied into the full buffer (ZeRO-1); returns the
        waits as (start, end) marks on the device's timeline (timing.py)."""
        waits = []
        for work, result in bucket.in_flight:
            if work is not None:
                begin = mark(result.device)
                work.wait()
                waits.append((begin, mark(result.device)))
            if self.shard_grads:
                first = bucket.start // self.dp
                self.shard_data[first:first + result.numel()].add_(result)
            elif self.distributed:
                a, b = bucket.shard(self.dp_rank, self.dp)
                self.grad_data[a:b].copy_(result)
        bucket.in_flight = []
        return waits

    def finish(self, landed: Callable[[Bucket], None] | None = None) -> list[tuple[Mark, Mark]]:
        """Launch what has not been launched, wait for every reduction, telling `landed` of each bucket whose
        slice is then final; returns the waits (marks: read them with timing.seconds once the step is done)."""
        for bucket in self.buckets:
            unlaunched = bucket.data is not None if self.shard_grads else not bucket.in_flight
            if unlaunched:  # ZeRO-2: gradients accumulated since its last launch; else: not launched this step
                self._launch(bucket)
        waits = []
        for bucket in self.buckets:
            waits += self._land(bucket)
            if landed is not None:
                landed(bucket)
        return waits

    def wait(self) -> None:
        """Wait for the reductions in flight without landing them (closing after an interrupted step)."""
        for bucket in self.buckets:
            for work, _ in bucket.in_flight:
                if work is not None:
                    work.wait()
            bucket.in_flight = []

    def zero(self) -> None:
        if self.grad_data is not None:
            self.grad_data.zero_()
        else:
            self.shard_data.zero_()
        self.syncing = False
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}

    def _shard_index(self, param: nn.Parameter, lo: int) -> int:
        """Where element `lo` of `param`, in a range this rank owns, sits in the sharded layout."""
        bucket = self.bucket_of[id(param)]
        return bucket.start // self.dp + self.offsets[id(param)][0] + lo - bucket.shard(self.dp_rank, self.dp)[0]

    def owned_grad(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of elements [lo, hi) of `param`, a range this rank owns (owned_ranges)."""
        if not self.shard_grads:
            return param.main_grad.view(-1)[lo:hi]
        first = self._shard_index(param, lo)
        return self.shard_data[first:first + hi - lo]

    def owned_weights(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The stored values of elements [lo, hi) of `param` (an owned range): what the optimizer updates."""
        if not self.shard_params:
            return param.data.view(-1)[lo:hi]
        first = self._shard_index(param, lo)
        return self.param_shard[first:first + hi - lo]

    def owned_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(param, first, last) element ranges, within each parameter, that this rank's optimizer shard owns."""
        owned = []
        for bucket in self.buckets:
            a, b = bucket.shard(self.dp_rank, self.dp) if self.distributed else (bucket.start, bucket.end)
            for param in bucket.params:
                start, end = self.offsets[id(param)]
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    owned.append((param, lo - start, hi - start))
        return owned
