"""Data parallelism: this rank's gradients, reduced over its data-parallel replicas.

Gradients accumulate in one flat buffer per model chunk (grad_buffer.py) whose buckets reduce
over the data-parallel group while backward goes on. Two kinds of gradient need more than
that reduction before the optimizer may read them, and are finished here:
- tied word embeddings split over pipeline stages: the first stage's embedding and the last
  stage's tied copy are summed over the embedding group, before the data-parallel reduction
  (the two stages' buffers differ in layout, so after a reduce-scatter a rank would own
  different slices of the embedding on each stage);
- under sequence parallelism, a replicated parameter's gradient (norm weights, biases of row-
  parallel layers) is partial on each tensor-parallel rank, which saw only its slice of the
  sequence: it is summed over the tensor-parallel group (buffer layouts are identical there).
Under context parallelism each rank's gradients come from its part of every sequence, and its
weights are the same as its context-parallel peers': the reduction spans data- and context-
parallel ranks together (topology.dp_cp_group). What the optimizer then does with the gradients
lives in distributed_optimizer.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import TORCH_DTYPES, ParallelConfig
from megalite.parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel.layers import parameter_shards
from megalite.parallel.timing import Mark, seconds
from megalite.parallel.topology import Topology


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum tensors over `group` in place, in one collective over a flat copy."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


class DataParallelGrads:
    """`chunks`: the parameters of each model chunk, in the order its backward produces them.
    `tied`: the names of this rank's parameters summed with another pipeline stage's (the word
    embeddings and their tied copy, when the model ties them and pp > 1). `tied_copies`: the
    names of the parameters that copy another one (never counted as replicated weights). `units`: each
    parameter's ZeRO-3 gather unit (zero3.py unit_index), which buckets do not straddle."""

    def __init__(self, model: nn.Module, chunks: list[list[nn.Parameter]], topology: Topology, cfg: ParallelConfig,
                 tied: set[str] = frozenset(), tied_copies: set[str] = frozenset(),
                 units: dict[int, int] | None = None) -> None:
        self.topology, self.sequence_parallel = topology, cfg.sequence_parallel_active
        shards = parameter_shards(model)
        named = list(model.named_parameters())
        self.replicated = [p for n, p in named if n not in shards and n not in tied_copies]
        self.tied = [p for n, p in named if n in tied]
        held = frozenset(id(p) for p in self.tied)
        self.buffers = [GradBuffer(params, cfg.bucket_size, topology.dp_cp_group, topology.dp_cp, topology.dp_cp_rank,
                                   cfg.zero >= 1, cfg.overlap_grad_reduce, held, TORCH_DTYPES[cfg.grad_reduce_dtype],
                                   shard_grads=cfg.zero >= 2, shard_params=cfg.zero >= 3, units=units)
                        for params in chunks if params]
        self.waits: list[tuple[Mark, Mark]] = []

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero()

    def wait(self) -> None:
        """Wait for every reduction still in flight (a step cut short leaves some); their results are dropped."""
        for buffer in self.buffers:
            buffer.wait()

    @property
    def wait_seconds(self) -> float:
        """How long the last step's reductions kept the device waiting after backward (reading it waits for
        the device: on a GPU the waits are CUDA-event intervals, not host time, since NCCL waits do not
        block the host)."""
        return sum(seconds(start, end) for start, end in self.waits)

    def start_sync(self, chunk: int) -> None:
        """The next backward is chunk `chunk`'s last of the step: reduce its buckets as they fill."""
        self.buffers[chunk].start_sync()

    def reduce(self, landed: Callable[[Bucket], None] | None = None) -> None:
        """Every gradient final: summed over the embedding group, reduced over data-parallel replicas
        (each rank's own slice under the distributed optimizer), summed over TP where SP left it partial.
        `landed` hears of each bucket as soon as its gradients are final (under SP, those holding replicated
        parameters only after the TP sum)."""
        t = self.topology
        if self.tied and t.embedding_group is not None:
            all_reduce_flat([p.main_grad for p in self.tied], t.embedding_group)
        replicated = {id(p) for p in self.replicated} if self.sequence_parallel else set()
        later: list[Bucket] = []

        def final(bucket: Bucket) -> None:
            if any(id(p) in replicated for p in bucket.params):
                later.append(bucket)
            elif landed is not None:
                landed(bucket)

        self.waits = [wait for buffer in self.buffers for wait in buffer.finish(final)]
        if self.sequence_parallel:
            owned = [(b, p, lo, hi) for b in self.buffers for p, lo, hi in b.owned_ranges() if id(p) in replicated]
            all_reduce_flat([b.owned_grad(p, lo, hi) for b, p, lo, hi in owned], t.tp_group)
        for bucket in later if landed is not None else []:
            landed(bucket)
