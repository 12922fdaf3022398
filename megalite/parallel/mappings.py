"""Communication as autograd functions: each forward collective has its conjugate as backward.

Tensor-parallel regions (Megatron-LM's scheme):
  copy_to_tp        identity      / all-reduce     (enter a column-parallel layer)
  reduce_from_tp    all-reduce    / identity       (leave a row-parallel layer)
  gather_from_tp    all-gather    / split          (along the last dim)
Sequence parallelism, along the first (sequence) dim of [seq, batch, hidden]:
  gather_from_sp    all-gather    / reduce-scatter (enter a column-parallel layer)
  reduce_scatter_to_sp reduce-scatter / all-gather (leave a row-parallel layer)
  scatter_to_sp     split         / all-gather     (enter the sequence-parallel region)
With a group of one every function is the identity, so tp=1 pays nothing.

Under autocast, norms return fp32 while the matmuls after them compute in bf16/fp16; `in_compute_dtype`
casts a column-parallel layer's input before its collective, so the all-gather (and its backward's
reduce-scatter or all-reduce) moves the compute dtype, half the bytes, as in Megatron-LM's bf16 runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

Group = dist.ProcessGroup


def all_gather_single(output: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False) -> dist.Work | None:
    """All-gather into one tensor: torch 2.13's all_gather_single, all_gather_into_tensor before it."""
    gather = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    return gather(output, x, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, x: torch.Tensor, group: Group,
                          async_op: bool = False) -> dist.Work | None:
    """Sum-reduce-scatter of one tensor: torch 2.13's reduce_scatter_single, reduce_scatter_tensor before it."""
    scatter = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else dist.reduce_scatter_tensor
    return scatter(output, x, group=group, async_op=async_op)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if dim == 0:
        all_gather_single(out, x.contiguous(), group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel size {size}")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _SequenceParallelLinear(torch.autograd.Function):
    """all_gather(x) @ weight^T + bias keeping only the local sequence shard x for backward, as Megatron-LM's
    sequence-parallel linear does: backward gathers x again while the input gradient's matmul runs, then
    reduce-scatters that gradient. Saves (tp - 1)/tp of the layer's input activations for one all-gather.
    Matmuls run in x's dtype (the compute dtype, see in_compute_dtype); weight gradients come back in the
    parameter's dtype, as autocast's cast would give them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.group = group
        dtype = x.dtype
        return F.linear(_gather(x, 0, group), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        whole = torch.empty((dist.get_world_size(ctx.group) * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                            device=x.device)
        gathering = all_gather_single(whole, x.contiguous(), ctx.group, async_op=True)
        grad_input = grad.matmul(weight.to(grad.dtype))  # overlaps the gather
        gathering.wait()
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = rows.t().matmul(whole.reshape(-1, whole.shape[-1]).to(grad.dtype)).to(weight.dtype)
        grad_bias = None if bias is None else rows.sum(0).to(bias.dtype)
        return _reduce_scatter(grad_input, ctx.group), grad_weight, grad_bias, None


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group: Group | None) -> torch.Tensor:
    """A column-parallel layer's matmul on a sequence-parallel input (gathered along the sequence)."""
    if _trivial(group):
        return F.linear(x, weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group)


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype when autocast is on for its device (the next matmul would cast it anyway)."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def _trivial(group: Group | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def copy_to_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _GatherFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _ScatterToSP.apply(x, group)
