"""The gradients of one model chunk's parameters on one replica group, bucketed and reduced as they fill.

Where each parameter's elements sit is the bucket layout's (bucket_layout.py); how the gradients are
stored and reduced, and the parameters shared, is the ZeRO stage's strategy (zero/). This buffer moves
each backward's gradients into the main gradients and decides when a bucket is complete. It is its
parameters' gradient sink (weight_grads.py GradSink): the layers' backward deposits every gradient there
(a matmul adds dW straight in), and so does a hook after autograd accumulated one (parameters whose
gradient autograd computes), into `param.main_grad`. A parameter read by several modules in one forward (a
tied embedding: its lookup and the LM head on the same stage; a multi-token-prediction head would be a
third) gets one gradient per reader: all but the last to arrive wait beside the buffer, the last adds them in,
and only then is the parameter's gradient of that backward complete. Once all of a bucket's gradients of one
backward are in, the bucket is reduced asynchronously while backward goes on: during the last micro batch's
backward (`start_sync`) at stages 0-1, after every backward at stages 2-3. Gradients are fp32 by default
whatever the parameters' dtype (`parallel.grad_reduce_dtype`).

Reduction sums over the replicas: every micro batch's loss is already divided by the token count of
the whole global batch (training/step.py), so the sum is the global mean for any (dp, micro batch) split.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.bucket_layout import Bucket, BucketLayout
from megalite.parallel.fp8.recipes import Float8
from megalite.parallel.timing import Mark
from megalite.parallel.weight_grads import set_sink
from megalite.parallel.zero import STAGES


def readers(modules: list[list[tuple[nn.Module, list[nn.Parameter]]]]) -> dict[int, int]:
    """How many modules read each parameter in one forward (so give it a gradient in one backward), by id, from
    each model chunk's (module, parameters its forward reads) (GPTModel.chunk_modules)."""
    return dict(Counter(id(p) for chunk in modules for _, params in chunk for p in params))


class GradBuffer:
    """`params` in creation order; `replicas` ranks of `group` (this one is `rank`) hold the same parameters
    and reduce their gradients at ZeRO `stage`. `held` parameters' buckets are not reduced during backward
    but only in `finish`, after their gradients were combined with another stage's (tied embeddings, see
    ddp.py). `units` maps each parameter to its ZeRO-3 gather unit, which buckets do not straddle. `reads`:
    how many modules read a parameter per forward (`readers`), by id, where more than one.
    `fp8`: the recipes of the weights gathered in FP8 (train.fp8_param_gather), by id.
    `on_grads_in` is told of each bucket whose gradients of one backward are all in (ZeRO-3 frees its
    parameters then)."""

    def __init__(self, params: list[nn.Parameter], bucket_size: int, group: dist.ProcessGroup | None,
                 replicas: int, rank: int, stage: int, overlap: bool, held: frozenset[int] = frozenset(),
                 grad_dtype: torch.dtype = torch.float32, units: dict[int, int] | None = None,
                 reads: dict[int, int] | None = None, fp8: dict[int, Float8] | None = None) -> None:
        fp8 = {id(p): fp8[id(p)] for p in params if id(p) in fp8} if fp8 else {}
        self.layout = BucketLayout(list(reversed(params)), bucket_size, replicas, units, frozenset(fp8))
        stage = 2 if stage == 3 and replicas == 1 else stage  # one replica: nothing to shard the parameters over
        self.strategy = STAGES[stage](self.layout, group, rank, params, grad_dtype, fp8)
        self.rank, self.overlap = rank, overlap
        self.on_grads_in: Callable[[Bucket], None] | None = None
        self.pending = {b.index: {id(p) for p in b.params} for b in self.layout.buckets}
        self.held = {b.index for b in self.layout.buckets if any(id(p) in held for p in b.params)}
        self.reads = {id(p): (reads or {}).get(id(p), 1) for p in params}
        self.unread = dict(self.reads)  # readers whose gradient of this backward has not come yet
        self.waiting: dict[int, torch.Tensor] = {}  # gradients of this backward's earlier readers, by parameter id
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_grad)
            set_sink(param, self)
        self.syncing = False

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    @property
    def bucket_of(self) -> dict[int, Bucket]:
        return self.layout.bucket_of

    def _on_grad(self, param: nn.Parameter) -> None:
        """After autograd accumulated a gradient into param.grad: deposit it. Autograd also calls this when a
        layer handed it no gradient, having deposited it itself (weight_grads.py)."""
        grad, param.grad = param.grad, None
        if grad is not None:
            self.deposit(param, lambda main: main.add_(grad))

    def deposit(self, param: nn.Parameter, add: Callable[[torch.Tensor], None]) -> None:
        """The sink (weight_grads.GradSink): add(target) adds one reader's gradient of `param` of this backward.
        The rule for several readers: each but the last to come adds into what waits for the parameter (in its
        dtype, so a matmul's dW is accumulated as the main gradient would be, never rounded to the compute dtype),
        the last into the main gradient, which then takes what waited; only then is the parameter's gradient of
        this backward in, and when its bucket's all are, the bucket may be reduced."""
        key = id(param)
        self.unread[key] -= 1
        if self.unread[key]:
            if key not in self.waiting:
                self.waiting[key] = torch.zeros_like(param)
            add(self.waiting[key])
            return
        self.unread[key] = self.reads[key]  # for the next backward
        bucket = self.layout.bucket_of[key]
        self.strategy.grads(bucket)
        add(param.main_grad)
        if key in self.waiting:
            param.main_grad.add_(self.waiting.pop(key))
        pending = self.pending[bucket.index]
        pending.discard(id(param))
        if pending:
            return
        pending.update(id(p) for p in bucket.params)  # for the next backward
        if bucket.index not in self.held and (self.strategy.every_micro_batch or self.syncing and self.overlap):
            self.strategy.launch(bucket)
            if not self.overlap:  # stages 2-3 without overlap: each micro batch's reduction lands at once
                self.strategy.land(bucket)
        if self.on_grads_in is not None:
            self.on_grads_in(bucket)

    def start_sync(self) -> None:
        """The chunk's next gradients are its last of the step (its last backward, or under a zero-bubble
        schedule its last W): reduce buckets as they complete."""
        self.syncing = True

    def finish(self, landed: Callable[[Bucket], None] | None = None) -> list[tuple[Mark, Mark]]:
        """Launch what has not been launched, wait for every reduction, telling `landed` of each bucket whose
        slice is then final; returns the waits (marks: read them with timing.seconds once the step is done)."""
        strategy = self.strategy
        for bucket in self.layout.buckets:
            if strategy.pending_launch(bucket):
                strategy.launch(bucket)
        waits = []
        for bucket in self.layout.buckets:
            waits += strategy.land(bucket)
            if landed is not None:
                landed(bucket)
        return waits

    def wait(self) -> None:
        """Wait for the reductions in flight without landing them (closing after an interrupted step)."""
        self.strategy.wait()

    def zero(self) -> None:
        self.strategy.zero()
        self.syncing = False
        self.unread, self.waiting = dict(self.reads), {}
        for bucket in self.layout.buckets:
            self.pending[bucket.index] = {id(p) for p in bucket.params}

    def owned_ranges(self) -> list[tuple[nn.Parameter, int, int]]:
        """(param, first, last) element ranges, within each parameter, that this rank's optimizer steps."""
        return self.layout.owned_ranges(self.rank, self.strategy.sharded_optimizer)

    def owned_grad(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        return self.strategy.owned_grad(param, lo, hi)

    def owned_weights(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        return self.strategy.owned_weights(param, lo, hi)
