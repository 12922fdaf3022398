"""Gradient reduction, the optimizer's view of the parameters, and the global gradient norm.

Gradients accumulate in per-chunk flat buffers (grad_buffer.py) that reduce over data-parallel
replicas, overlapped with backward; the tied word embeddings' gradients are first summed
between the first and last pipeline stage. Then, under sequence parallelism, a replicated
parameter's gradient (partial on each tensor-parallel rank, which saw only its slice of the
sequence; buffer layouts are identical across TP ranks) is summed over the TP group.

The optimizer steps fp32 "main" tensors: the parameters themselves, or with the distributed
optimizer only the slices this data-parallel rank owns (views into the flat parameter buffer,
all-gathered after the step). Parameters kept in bf16/fp16 (`train.param_dtype`) get fp32
copies as main tensors instead, written back into the parameters after each step, so small
updates are not lost to rounding (Megatron-LM's --bf16). The global norm counts each element once: tensor-parallel
shards on every rank, replicated parameters on TP rank 0, the tied copy never, each
data-parallel shard on its owner.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import TORCH_DTYPES, ParallelConfig
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
                                   self.distributed, cfg.overlap_grad_reduce, held, TORCH_DTYPES[cfg.grad_reduce_dtype]) for params in chunks if params]
        self.main, self._grad_views, self._copies = self._main_tensors()
        self.gather_in_background = self.distributed and cfg.overlap_param_gather
        if self.gather_in_background:
            self._wait_before_use(model)
        self.wait_seconds = 0.0

    def _main_tensors(self) -> tuple[list[tuple[nn.Parameter, nn.Parameter]], list[torch.Tensor], list[tuple[torch.Tensor, nn.Parameter]]]:
        """(model parameter, tensor the optimizer steps) pairs, the gradient view each main tensor
        steps with, and (parameter storage, fp32 copy) pairs to write back after a step. Distributed
        shards are flat slices with `owner_range`; fp32 ones share the parameter's storage."""
        pairs, grads, copies = [], [], []
        for buffer in self.buffers:
            for param, lo, hi in buffer.owned_ranges():
                target = param.data.view(-1)[lo:hi] if self.distributed else param.data
                if param.dtype == torch.float32:
                    main = param if not self.distributed else nn.Parameter(target, requires_grad=False)
                else:
                    main = nn.Parameter(target.float(), requires_grad=False)
                    copies.append((target, main))
                if self.distributed:
                    main.owner_range = (lo, hi)
                pairs.append((param, main))
                grads.append(param.main_grad.view(-1)[lo:hi] if self.distributed else param.main_grad)
        return pairs, grads, copies

    def _wait_before_use(self, model: nn.Module) -> None:
        """Forward pre-hooks that wait for the in-flight gathers of a module's own parameters."""
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if params:
                module.register_forward_pre_hook(lambda _module, _args, params=params: self.wait_for(params))

    def wait_for(self, params: list[nn.Parameter]) -> None:
        for buffer in self.buffers:
            buffer.wait_for(params)

    def wait_params(self) -> None:
        """Every parameter up to date: before evaluating or saving outside a training step."""
        for buffer in self.buffers:
            buffer.wait_gathers()

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
        for (_, main), grad in zip(self.main, self._grad_views):
            main.grad = grad if grad.dtype == main.dtype else grad.to(main.dtype)

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer uses."""
        return [main.grad for _, main in self.main]

    def norm(self) -> torch.Tensor:
        """The global gradient norm, as a one-element tensor on the device."""
        t = self.topology
        counted = [main.grad for param, main in self.main if id(param) in self.counted]
        total = torch.stack(torch._foreach_norm(counted)).float().pow(2).sum() if counted else torch.zeros((), device=t.device)
        total = total.reshape(1)
        group = dist.group.WORLD if self.distributed else t.mp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total.sqrt()

    def clip(self, max_norm: float, grad_scale: torch.Tensor) -> float:
        """Multiply the gradients by `grad_scale` (a one-element tensor), scaled down further so the global
        norm is at most max_norm (0 disables), in one pass; returns the norm before clipping."""
        norm = float(self.norm() * grad_scale)
        factor = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 and norm == norm else 1.0
        torch._foreach_mul_(self.grads(), grad_scale * factor)
        return norm

    def any_overflow(self, found: bool) -> bool:
        """Whether any rank found inf/nan, so all ranks skip the same steps."""
        return bool(self.topology.max_over_ranks([float(found)])[0])

    def gather_params(self) -> None:
        """Every parameter whole again from the ranks that own its slices (distributed optimizer), e.g.
        after a resume that loaded only this rank's slices."""
        if self.distributed:
            for buffer in self.buffers:
                buffer.gather_params(background=False)

    def after_step(self) -> None:
        """Write fp32 main weights back into bf16/fp16 parameters and share updated shards (distributed
        optimizer); drop .grad so the next backward starts clean."""
        if self._copies:
            torch._foreach_copy_([target for target, _ in self._copies], [main for _, main in self._copies])
        if self.distributed:
            for buffer in self.buffers:
                buffer.gather_params(self.gather_in_background)
        for param, main in self.main:
            param.grad = main.grad = None
