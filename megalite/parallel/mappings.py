"""Communication as autograd functions: each forward collective has its conjugate as backward.

Tensor-parallel regions (Megatron-LM's scheme):
  copy_to_tp        identity      / all-reduce     (enter a column-parallel layer)
  reduce_from_tp    all-reduce    / identity       (leave a row-parallel layer)
  gather_from_tp    all-gather    / split          (along the last dim)
Sequence parallelism, along the first (sequence) dim of [seq, batch, hidden]:
  gather_from_sp    all-gather    / reduce-scatter (enter a column-parallel layer)
  reduce_scatter_to_sp reduce-scatter / all-gather (leave a row-parallel layer)
  scatter_to_sp     split         / all-gather     (enter the sequence-parallel region)
Context parallelism, along the sequence dim of keys and values:
  gather_from_cp    all-gather    / reduce-scatter (all-gather attention: every rank's keys and values)
Expert parallelism, along the token dim of [tokens, hidden]:
  all_to_all        all-to-all    / all-to-all, splits swapped (tokens to their experts' ranks and back)
  gather_from_ep    all-gather    / reduce-scatter (the all-gather dispatcher: every rank's tokens)
  reduce_scatter_to_ep reduce-scatter / all-gather (its combine: each rank's tokens, summed over experts)
  gather_rows_v     all-gather    / reduce-scatter, uneven row counts (rows for the experts' tensor-parallel
                                    ranks; padded to the largest, so every backend and NCCL's rules allow it)
  reduce_scatter_rows_v reduce-scatter / all-gather, uneven (the experts' partial outputs back to their rows)
The linear layers' matmuls, and the sequence-parallel all-gather inside them, are in gemm.py.
With a group of one every function is the identity, so tp=1 pays nothing.

Under autocast, norms return fp32 while the matmuls after them compute in bf16/fp16; `in_compute_dtype`
casts a column-parallel layer's input before its collective, so the all-gather (and its backward's
reduce-scatter or all-reduce) moves the compute dtype, half the bytes, as in Megatron-LM's bf16 runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.pipeline.overlap import travel

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


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the first (sequence) dimension, rank-major."""
    out = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group)
    return out


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def local_rows(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """This rank's slice of the first (sequence) dimension, outside autograd (position ids, masks)."""
    return x if _trivial(group) else _split(x, 0, group)


def reduce_scatter_rows(x: torch.Tensor, group: Group, what: str = "tensor-parallel") -> torch.Tensor:
    """Sum over the group, each rank keeping its slice of the first (sequence) dimension; `what` names the
    group in the error for a sequence it does not divide."""
    return start_reduce_scatter_rows(x, group, what, async_op=False)[0]


def start_reduce_scatter_rows(x: torch.Tensor, group: Group, what: str = "tensor-parallel",
                              async_op: bool = True) -> tuple[torch.Tensor, dist.Work | None]:
    """`reduce_scatter_rows` launched: its output and the work to wait on before reading it (None when not
    `async_op`). x must stay untouched until then."""
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by {what} size {size}")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, reduce_scatter_single(out, x.contiguous(), group, async_op=async_op)


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
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad, ctx.group, ctx.what), None, None


def all_to_all_rows(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int],
                    forward: bool = True) -> torch.Tensor:
    """Rows in_splits[r] of x go to rank r; rows out_splits[r] come from rank r, in rank order. While it travels,
    the other part of a paired pipeline operation may run (pipeline/overlap.py `travel`; `forward`: called from
    a forward)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    travel(dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True), forward)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.splits = group, (in_splits, out_splits)
        return all_to_all_rows(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.group, *ctx.splits, forward=False), None, None, None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))]) if rows > x.shape[0] else x


def gather_rows_uneven(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows, sizes[r] of them from rank r, in rank order."""
    most = max(sizes)
    out = x.new_empty((len(sizes) * most, *x.shape[1:]))
    all_gather_single(out, _pad_rows(x, most).contiguous(), group)
    return torch.cat([out[r * most:r * most + n] for r, n in enumerate(sizes)])


def reduce_scatter_rows_uneven(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Rows sizes[r] (in order) summed over the group onto rank r."""
    most = max(sizes)
    out = x.new_empty((most, *x.shape[1:]))
    reduce_scatter_single(out, torch.cat([_pad_rows(part, most) for part in x.split(sizes)]).contiguous(), group)
    return out[:sizes[dist.get_rank(group)]]


class _GatherRowsV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return gather_rows_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows_uneven(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterRowsV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return reduce_scatter_rows_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows_uneven(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.group), None


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
    return x if _trivial(group) else _GatherRows.apply(x, group, "tensor-parallel")


def gather_from_cp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _GatherRows.apply(x, group, "context-parallel")


def reduce_scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _ScatterToSP.apply(x, group)


def all_to_all(x: torch.Tensor, group: Group | None, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    return x if _trivial(group) else _AllToAll.apply(x, group, out_splits, in_splits)


def gather_from_ep(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _GatherRows.apply(x, group, "expert-parallel")


def reduce_scatter_to_ep(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if _trivial(group) else _ReduceScatterToSP.apply(x, group)


def gather_rows_v(x: torch.Tensor, group: Group | None, sizes: list[int]) -> torch.Tensor:
    return x if _trivial(group) else _GatherRowsV.apply(x, group, sizes)


def reduce_scatter_rows_v(x: torch.Tensor, group: Group | None, sizes: list[int]) -> torch.Tensor:
    return x if _trivial(group) else _ReduceScatterRowsV.apply(x, group, sizes)
