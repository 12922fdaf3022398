"""ZeRO-3: parameters stored sharded over the data-parallel ranks, whole only around their use.

`ShardedParameters` is stage 2 (zero/stages.py) whose ranks also keep only their slices of the
parameters (`param_shard`, the same layout as their gradient and optimizer slices); each bucket's
whole parameters have a storage of their own, gathered and freed around their use. `GatherUnits`
decides when: the model's gather units are the modules its forward runs, in order
(GPTModel.chunk_modules: the embedding, each transformer layer, the final norm, the LM head, multi-token
prediction); a unit's buckets are all-gathered just before its forward and freed after it; they are gathered
again before its backward and freed once all of the bucket's gradients of that backward are in (they are then
reduce-scattered, as under stage 2). While a unit runs, the next one's gather is already in flight
(the previous one's in backward), so communication overlaps compute with at most two units gathered
in forward. A module appears once among the units, however often it runs (the LM head once more per MTP depth,
counted among its reads): a unit listed twice would prefetch, in backward, a unit whose gradients are all in,
which then stays gathered with stale weights.

Why megalite's own buffers and not torch's FSDP2 (`fully_shard`): the shards are the distributed
optimizer's slices, so fp32 main weights, clipping (each element counted once), CPU offload and the
layout-free checkpoint work unchanged at every stage, and a ZeRO-3 checkpoint is the same pieces as a
ZeRO-1 one. FSDP2 shards each parameter as a DTensor on dim 0, which would give tensor-parallel shards
a second sharding the optimizer, checkpoints and the TP layers know nothing of. Freeing is done by
shrinking the bucket storage to zero bytes, as FSDP1 did: parameters stay views of it, so autograd's
saved references and shapes stay valid.

Under a zero-bubble schedule a unit's backward is its B, and its weight gradients come later, in W, which
reads no parameter: the unit is freed when its B ends (`backward_done`), and its buckets are
reduce-scattered when W has put all their gradients in.

Activation recompute runs a unit's forward again inside its backward, when the unit is gathered
and marked as in backward: that forward neither counts as a user, prefetches nor frees (torch's
checkpoint stops a recompute early, once it has what backward needs, so its forward hook may
never run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from megalite.parallel.bucket_layout import Bucket, BucketLayout
from megalite.parallel.fp8.recipes import Float8
from megalite.parallel.mappings import all_gather_single
from megalite.parallel.storage import resize_storage
from megalite.parallel.zero.stages import ShardedGradients


class ShardedParameters(ShardedGradients):
    """Stage 3: each rank stores its slice of the parameters; a bucket is whole only while gathered. An FP8
    bucket (train.fp8_param_gather) is quantised after each step and gathered as FP8 bytes at each use; its
    parameters' own storage is never whole again."""

    keeps_whole_params = False

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None, rank: int,
                 params: list[nn.Parameter], grad_dtype: torch.dtype, fp8: dict[int, Float8] | None = None) -> None:
        self.weights: dict[int, torch.Tensor] = {}  # bucket index -> its whole parameters' storage
        super().__init__(layout, group, rank, params, grad_dtype, fp8)
        for bucket in (b for b in layout.buckets if b.fp8):
            self.float8.free(bucket)

    def _store_params(self, params: list[nn.Parameter]) -> None:
        """Each bucket's parameters become views of its own storage; only this rank's slices are kept
        (`param_shard`) and the bucket storage is freed until it is gathered."""
        self.param_shard = self._param_storage(self.layout.size // self.replicas, params[0].dtype)
        for bucket in self.layout.buckets:
            weights = self.weights[bucket.index] = self._param_storage(bucket.end - bucket.start, params[0].dtype)
            for param in bucket.params:
                view = self._view(weights, param, bucket.start)
                view.copy_(param.data)
                param.data = view
            a, b = bucket.shard(self.rank, self.replicas)
            self.param_shard[self.layout.bucket_shard(bucket)].copy_(weights[a - bucket.start:b - bucket.start])
            resize_storage(weights, 0)

    def owned_weights(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        first = self.layout.shard_position(param, lo, self.rank)
        return self.param_shard[first:first + hi - lo]

    def gather_params(self, bucket: Bucket) -> dist.Work | None:
        """Nothing gathered after the step: each forward gathers what it uses (an FP8 bucket's slice is
        quantised now)."""
        return self._gather_fp8(bucket) if bucket.fp8 else None

    def gather(self, bucket: Bucket) -> dist.Work | None:
        """Launch the all-gather of the bucket's whole parameters into their (re-grown) storage (an FP8
        bucket's FP8 copy)."""
        if bucket.fp8:
            return self.float8.gather(bucket)
        weights = self.weights[bucket.index]
        resize_storage(weights, weights.numel() * weights.element_size())
        return all_gather_single(weights, self.param_shard[self.layout.bucket_shard(bucket)], self.group,
                                 async_op=True)

    def free(self, bucket: Bucket) -> None:
        if bucket.fp8:
            self.float8.free(bucket)
        else:
            resize_storage(self.weights[bucket.index], 0)


@dataclass
class GatheredBucket:
    """The gather state of one bucket: its whole parameters are present while `users` (forwards under way)
    is positive or `in_backward`; `work` is the gather in flight."""

    bucket: Bucket
    strategy: ShardedParameters
    present: bool = False
    users: int = 0
    in_backward: bool = False
    work: dist.Work | None = None

    @property
    def elements(self) -> int:
        return self.bucket.end - self.bucket.start


@dataclass
class Unit:
    module: nn.Module
    buckets: list[GatheredBucket] = field(default_factory=list)


def unit_index(chunks: list[list[tuple[nn.Module, list[nn.Parameter]]]]) -> dict[int, int]:
    """Each parameter's gather unit (by id): the unit of the module that owns it."""
    index, number = {}, 0
    for modules in chunks:
        for module, _ in modules:
            for param in module.parameters():
                index.setdefault(id(param), number)
            number += 1
    return index


class GatherUnits:
    """`chunks`: per model chunk, the modules its forward runs in order, each with the parameters it reads
    (GPTModel.chunk_modules); `buffers`: the gradient buffers, whose strategies are ShardedParameters. A
    module may read parameters of another chunk's buffer (the LM head the tied embedding)."""

    def __init__(self, chunks: list[list[tuple[nn.Module, list[nn.Parameter]]]], buffers: list) -> None:
        # Only buffers whose parameters are sharded take part: a grid with one data-parallel replica (the experts'
        # at edp 1, the dense ones at dp x cp 1) keeps its parameters whole, always present.
        buffers = [buffer for buffer in buffers if isinstance(buffer.strategy, ShardedParameters)]
        self.gathered: dict[int, GatheredBucket] = {}
        self.states = {id(b): GatheredBucket(b, buffer.strategy) for buffer in buffers for b in buffer.layout.buckets}
        where = {param: self.states[id(b)] for buffer in buffers for param, b in buffer.layout.bucket_of.items()}
        self.peak_buckets = self.peak_elements = 0
        self.units: list[list[Unit]] = []
        for modules in chunks:
            units = []
            for module, params in modules:
                unit = Unit(module)
                for param in params:
                    if id(param) in where and where[id(param)] not in unit.buckets:
                        unit.buckets.append(where[id(param)])
                units.append(unit)
            self.units.append(units)
        for units in self.units:
            for i, unit in enumerate(units):
                after = units[i + 1] if i + 1 < len(units) else None
                before = units[i - 1] if i > 0 else None
                unit.module.register_forward_pre_hook(lambda _m, _a, u=unit, n=after: self._before_forward(u, n))
                unit.module.register_forward_hook(lambda _m, _a, out, u=unit, p=before: self._after_forward(u, p, out))
        for buffer in buffers:
            buffer.on_grads_in = self._grads_in

    def _gather(self, state: GatheredBucket) -> None:
        """Launch the bucket's all-gather, unless its parameters are present."""
        if state.present:
            return
        state.work = state.strategy.gather(state.bucket)
        state.present = True
        self.gathered[id(state.bucket)] = state
        self.peak_buckets = max(self.peak_buckets, len(self.gathered))
        self.peak_elements = max(self.peak_elements, sum(s.elements for s in self.gathered.values()))

    @staticmethod
    def _wait(states: list[GatheredBucket]) -> None:
        for state in states:
            if state.work is not None:
                state.work.wait()
                state.work = None

    def wait_all(self) -> None:
        """Wait for every gather in flight (prefetches a cut-short step or evaluation left behind)."""
        self._wait(list(self.states.values()))

    def _release(self, state: GatheredBucket) -> None:
        """Free the bucket's whole parameters if nothing uses them (its gather has landed: it was waited for)."""
        if state.present and state.users == 0 and not state.in_backward:
            self._wait([state])
            state.strategy.free(state.bucket)
            state.present = False
            del self.gathered[id(state.bucket)]

    def _before_forward(self, unit: Unit, after: Unit | None) -> None:
        if any(s.in_backward for s in unit.buckets):  # a recompute: present until the backward frees it
            self._wait(unit.buckets)
            return
        for state in unit.buckets:
            self._gather(state)
            state.users += 1
        if after is not None:
            for state in after.buckets:
                self._gather(state)
        self._wait(unit.buckets)

    def _after_forward(self, unit: Unit, before: Unit | None, output: object) -> None:
        if any(s.in_backward for s in unit.buckets):
            return
        for state in unit.buckets:
            state.users -= 1
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads, u=unit, p=before: self._before_backward(u, p), mode="any")
        for state in unit.buckets:
            self._release(state)

    def _before_backward(self, unit: Unit, before: Unit | None) -> None:
        for state in unit.buckets:
            self._gather(state)
            state.in_backward = True
        if before is not None:
            for state in before.buckets:
                self._gather(state)
        self._wait(unit.buckets)

    def backward_done(self) -> None:
        """A backward ended. Under a zero-bubble schedule it was a B: its weight gradients come in W, which reads
        no parameter (parallel/weight_grads.py), so every unit still marked in backward is freed now rather
        than held until then (and the next forward is not taken for a recompute). After a fused backward every
        bucket's gradients are in, so nothing is left to free."""
        for state in list(self.gathered.values()):
            if state.in_backward:
                state.in_backward = False
                self._release(state)

    def _grads_in(self, bucket: Bucket) -> None:
        state = self.states[id(bucket)]
        state.in_backward = False
        self._release(state)
