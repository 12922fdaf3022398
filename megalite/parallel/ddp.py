"""Data parallelism: this rank's gradients, reduced over its data-parallel replicas.

Gradients accumulate in one flat buffer per model chunk (grad_buffer.py) whose buckets reduce
over the data-parallel group while backward goes on. Two kinds of gradient need more than
that reduction before the optimizer may read them, and are finished here:
- tied word embeddings split over pipeline stages: the first chunk's embedding and the last
  chunk's tied copy are summed over the embedding group (or on the rank itself, when ZB-V puts both
  chunks on rank 0), before the data-parallel reduction (the two chunks' buffers differ in layout,
  so after a reduce-scatter a rank would own different slices of the embedding in each);
- a gradient whose placement says it is partial over some axes (under sequence parallelism, a
  tensor-parallel-replicated norm weight or bias saw only its rank's slice of the sequence) is
  summed over those axes' group (buffer layouts are identical there).
The reduction itself spans the placement's data axes (placement.py DATA_AXES): under context
parallelism each rank's gradients come from its part of every sequence and its weights are its
context-parallel peers', so dense gradients reduce over data- and context-parallel ranks together.
What the optimizer then does with the gradients lives in distributed_optimizer.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import TORCH_DTYPES, ParallelConfig
from megalite.parallel.fp8.recipes import Float8
from megalite.parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel.placement import DATA_AXES, Placement
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
    """`chunks`: the parameters of each model chunk, in the order its backward produces them; `placements`:
    where each lives (by name). `tied`: the names of this rank's parameters summed with another pipeline
    stage's (the word embeddings and their tied copy, when the model ties them and pp > 1). `units`: each
    parameter's ZeRO-3 gather unit (zero/stage3.py unit_index), which buckets do not straddle. `reads`: how many
    modules read each parameter in one forward (grad_buffer.readers), where more than one. `fp8`: the weights
    gathered in FP8 (parallel/fp8/param_gather.py gathered_weights), with their recipes. Each chunk gets one
    buffer per grid its parameters live on, reduced over that grid's data axes."""

    def __init__(self, model: nn.Module, chunks: list[list[nn.Parameter]], topology: Topology, cfg: ParallelConfig,
                 placements: dict[str, Placement], tied: set[str] = frozenset(),
                 units: dict[int, int] | None = None, reads: dict[int, int] | None = None,
                 fp8: dict[int, Float8] | None = None) -> None:
        self.topology = topology
        named = list(model.named_parameters())
        self.partial: dict[tuple[str, tuple[str, ...]], list[nn.Parameter]] = {}  # (grid, axes) -> parameters
        for name, param in named:
            if placements[name].partial and not placements[name].copy:
                self.partial.setdefault((placements[name].grid, placements[name].partial), []).append(param)
        self.tied = [p for n, p in named if n in tied]
        held = frozenset(id(p) for p in self.tied)
        grid_of = {id(p): placements[n].grid for n, p in named}
        self.buffers, self.chunk_buffers = [], []  # every buffer; each chunk's (one per grid)
        for params in chunks:
            self.chunk_buffers.append([])
            for grid in dict.fromkeys(grid_of[id(p)] for p in params):
                axes = DATA_AXES[grid]
                self.chunk_buffers[-1].append(GradBuffer(
                    [p for p in params if grid_of[id(p)] == grid], cfg.bucket_size, topology.group(*axes, grid=grid),
                    topology.size(*axes, grid=grid), topology.coord(*axes, grid=grid), cfg.zero,
                    cfg.overlap_grad_reduce, held, TORCH_DTYPES[cfg.grad_reduce_dtype], units, reads, fp8))
                self.buffers.append(self.chunk_buffers[-1][-1])
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
        """The next operation computes chunk `chunk`'s last gradients of the step (its last backward, or its last
        W): reduce its buckets (of every grid) as they fill."""
        for buffer in self.chunk_buffers[chunk]:
            buffer.start_sync()

    def reduce(self, landed: Callable[[Bucket], None] | None = None) -> None:
        """Every gradient final: summed over the embedding group, reduced over the data axes (each rank's own
        slice under the distributed optimizer), summed over the axes their placement says they are partial
        over. `landed` hears of each bucket as soon as its gradients are final (those holding partial
        parameters only after that sum)."""
        t = self.topology
        if len(self.tied) == 2:  # the embedding and its copy on this rank
            total = self.tied[0].main_grad + self.tied[1].main_grad
            for param in self.tied:
                param.main_grad.copy_(total)
        elif self.tied and t.embedding_group is not None:
            all_reduce_flat([p.main_grad for p in self.tied], t.embedding_group)
        partial = {id(p) for params in self.partial.values() for p in params}
        later: list[Bucket] = []

        def final(bucket: Bucket) -> None:
            if any(id(p) in partial for p in bucket.params):
                later.append(bucket)
            elif landed is not None:
                landed(bucket)

        self.waits = [wait for buffer in self.buffers for wait in buffer.finish(final)]
        for (grid, axes), params in self.partial.items():
            members = {id(p) for p in params}
            owned = [(b, p, lo, hi) for b in self.buffers for p, lo, hi in b.owned_ranges() if id(p) in members]
            all_reduce_flat([b.owned_grad(p, lo, hi) for b, p, lo, hi in owned], t.group(*axes, grid=grid))
        for bucket in later if landed is not None else []:
            landed(bucket)
