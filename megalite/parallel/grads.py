"""Gradient reduction, the optimizer's view of the parameters, and the global gradient norm.

Gradients accumulate in per-chunk flat buffers (grad_buffer.py) that reduce over data-parallel
replicas, overlapped with backward; the tied word embeddings' gradients are first summed
between the first and last pipeline stage. Then, under sequence parallelism, a replicated
parameter's gradient (partial on each tensor-parallel rank, which saw only its slice of the
sequence; buffer layouts are identical across TP ranks) is summed over the TP group.

The optimizer steps "main" tensors: the parameters themselves, or with the distributed
optimizer only the slices this data-parallel rank owns (views into the flat parameter buffer,
all-gathered after the step). The global norm counts each element once: tensor-parallel
shards on every rank, replicated parameters on TP rank 0, the tied copy never, each
data-parallel shard on its owner.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import ParallelConfig
from megalite.parallel.grad_buffer import GradBuffer
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


def decay_groups(entries: Iterable[tuple[str, torch.Tensor, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Optimizer groups from (name, model parameter, tensor to step): no weight decay on biases and
    norm weights (decided on the model parameter, whatever slice of it is stepped)."""
    decay, no_decay = [], []
    for name, param, stepped in entries:
        (no_decay if param.ndim < 2 or name.endswith("bias") else decay).append(stepped)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class GradientReducer:
    """`tied` names the parameters shared between the first and last pipeline stage (the word
    embeddings and the last stage's copy); `copies` the ones that duplicate another (left out of the norm)."""

    def __init__(self, model: nn.Module, chunks: list[list[nn.Parameter]], topology: Topology, cfg: ParallelConfig,
                 tied: set[str] = frozenset(), copies: set[str] = frozenset()) -> None:
        self.topology, self.distributed = topology, cfg.distributed_optimizer
        self.sequence_parallel = cfg.sequence_parallel and topology.tp > 1
        shards = parameter_shards(model)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.replicated = [p for n, p in model.named_parameters() if n not in shards and n not in copies]
        self.tied = [p for n, p in model.named_parameters() if n in tied]
        self.counted = {id(p) for n, p in model.named_parameters() if n not in copies and (n in shards or topology.tp_rank == 0)}
        held = frozenset(id(p) for p in self.tied)
        self.buffers = [GradBuffer(params, cfg.bucket_size, topology.dp_group, topology.dp, topology.dp_rank,
                                   self.distributed, cfg.overlap_grad_reduce, held) for params in chunks if params]
        self.main = self._main_tensors()
        self.wait_seconds = 0.0

    def _main_tensors(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(model parameter, tensor the optimizer steps) pairs; shards are views sharing the parameter's storage."""
        if not self.distributed:
            return [(p, p) for buffer in self.buffers for p, _, _ in buffer.owned_ranges()]
        pairs = []
        for buffer in self.buffers:
            for param, lo, hi in buffer.owned_ranges():
                main = nn.Parameter(param.data.view(-1)[lo:hi], requires_grad=False)
                main.grad = param.main_grad.view(-1)[lo:hi]
                main.owner, main.owner_range = param, (lo, hi)
                pairs.append((param, main))
        return pairs

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups over the main tensors."""
        return decay_groups(((self.names[id(p)], p, main) for p, main in self.main), weight_decay)

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero()

    def start_sync(self, chunk: int) -> None:
        self.buffers[chunk].start_sync()

    def reduce(self) -> None:
        t = self.topology
        if self.tied and t.embedding_group is not None:
            # Before the data-parallel reduction: the two stages' buffers differ in layout, so after a
            # reduce-scatter a rank would own different slices of the embedding on each stage.
            all_reduce_flat([p.main_grad for p in self.tied], t.embedding_group)
        self.wait_seconds = sum(buffer.finish() for buffer in self.buffers)
        if self.sequence_parallel:
            all_reduce_flat([p.main_grad for p in self.replicated], t.tp_group)
        if not self.distributed:
            for param, _ in self.main:
                param.grad = param.main_grad

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer uses."""
        return [main.grad for _, main in self.main]

    def norm(self) -> float:
        t = self.topology
        counted = [main.grad for param, main in self.main if id(param) in self.counted]
        total = torch.stack(torch._foreach_norm(counted)).float().pow(2).sum() if counted else torch.zeros((), device=t.device)
        total = total.reshape(1)
        group = dist.group.WORLD if self.distributed else t.mp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return float(total.sqrt())

    def clip(self, max_norm: float) -> float:
        """Scale gradients so the global norm is at most max_norm (0 disables); returns the norm before."""
        norm = self.norm()
        if max_norm > 0 and norm == norm:
            torch._foreach_mul_(self.grads(), min(1.0, max_norm / (norm + 1e-6)))
        return norm

    def any_overflow(self, found: bool) -> bool:
        """Whether any rank found inf/nan, so all ranks skip the same steps."""
        if self.topology.world_size == 1:
            return found
        flag = torch.tensor([float(found)], device=self.topology.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def after_step(self) -> None:
        """Share updated shards (distributed optimizer); drop .grad so the next backward starts clean."""
        if self.distributed:
            for buffer in self.buffers:
                buffer.gather_params()
        for param, _ in self.main:
            param.grad = None
