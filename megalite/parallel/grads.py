"""Gradient reduction and global norm across the parallel layout.

After backward, a replicated parameter's gradient is partial on each tensor-parallel rank
under sequence parallelism (each saw only its slice of the sequence) and is summed over
the TP group; every gradient is then summed over data-parallel replicas. The global norm
counts each shard of a tensor-parallel parameter once and each replicated parameter once
(on TP rank 0), summed over the model-parallel group, so it equals the one-device norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.layers import parameter_shards
from megalite.parallel.topology import Topology


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum tensors over `group` in place, in one collective over a flat copy."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


class GradientReducer:
    """`tied` names the parameters shared between the first and last pipeline stage (the word
    embeddings and the last stage's copy): their gradients are summed over the embedding group,
    and the copy (`copies`) is left out of the norm so it counts once."""

    def __init__(self, model: nn.Module, topology: Topology, sequence_parallel: bool, tied: set[str] = frozenset(),
                 copies: set[str] = frozenset()) -> None:
        shards = parameter_shards(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.replicated = [p for n, p in named if n not in shards and n not in copies]
        self.sharded = [p for n, p in named if n in shards and n not in copies]
        self.tied = [p for n, p in named if n in tied]
        self.topology = topology
        self.sequence_parallel = sequence_parallel and topology.tp > 1

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params]

    def reduce(self) -> None:
        t = self.topology
        if self.sequence_parallel:
            all_reduce_flat([p.grad for p in self.replicated], t.tp_group)
        if self.tied and t.embedding_group is not None:
            all_reduce_flat([p.grad for p in self.tied], t.embedding_group)
        if t.dp > 1:
            all_reduce_flat(self.grads(), t.dp_group)

    def _sum_of_squares(self, params: list[nn.Parameter]) -> torch.Tensor:
        if not params:
            return torch.zeros((), device=self.topology.device)
        norms = torch._foreach_norm([p.grad for p in params])
        return torch.stack(norms).float().pow(2).sum()

    def norm(self) -> float:
        t = self.topology
        total = self._sum_of_squares(self.sharded)
        if t.tp_rank == 0:
            total = total + self._sum_of_squares(self.replicated)
        total = total.reshape(1)
        if t.tp * t.pp > 1:
            dist.all_reduce(total, group=t.mp_group)
        return float(total.sqrt())

    def clip(self, max_norm: float) -> float:
        """Scale gradients so the global norm is at most max_norm (0 disables); returns the norm before."""
        norm = self.norm()
        if max_norm > 0 and norm == norm:
            torch._foreach_mul_(self.grads(), min(1.0, max_norm / (norm + 1e-6)))
        return norm

    def any_overflow(self, found: bool) -> bool:
        """Whether any model-parallel rank found inf/nan, so all ranks skip the same steps."""
        t = self.topology
        if t.tp * t.pp == 1:
            return found
        flag = torch.tensor([float(found)], device=t.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=t.mp_group)
        return bool(flag.item())
