"""Tensor-parallel layers (Megatron-LM's column/row scheme) and where their weights live.

A ColumnParallelLinear splits its output features across the TP group, a RowParallelLinear
its input features, a VocabParallelEmbedding the vocabulary rows; a DuplicatedLinear is whole on every rank.
Each layer declares its split parameters' placements (parallel/placement.py), so initialisation, gradient reduction,
the norm and checkpoints can move between full tensors and per-rank shards without knowing the model. Every
matmul runs through gemm.py, with the layer's `recipe` (gemm.apply_recipe changes it), every lookup through
lookup.py, and each hands its weight gradient to weight_grads.py (in W under a zero-bubble schedule); so does
the bias a row-parallel layer adds after its reduction, when the schedule splits the backward
(`recompute_bias`, set by model/split_backward.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.lookup import embedding
from megalite.parallel.mappings import copy_to_tp, in_compute_dtype, reduce_from_tp, reduce_scatter_to_sp
from megalite.parallel.placement import Placement, default_placement
from megalite.parallel.weight_grads import recomputed


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group: dist.ProcessGroup | None, recipe: gemm.Recipe) -> torch.Tensor:
    """A column-parallel layer's matmul on a sequence-parallel input (gathered along the sequence)."""
    return gemm.linear(x, weight, bias, gather_group=group, recipe=recipe)


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return y + bias


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split across ranks; output stays split."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, bias: bool,
                 blocks: int = 1) -> None:
        super().__init__()
        self.ctx = ctx
        local = _divide(out_features, ctx.tp.size * blocks, "output features / blocks") * blocks
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        self.placements = {"weight": Placement.split("tp", 0, blocks), "bias": Placement.split("tp", 0, blocks)}
        self.recipe = gemm.HIGH_PRECISION
        self.operand_splits = ctx.operand_splits(out="tp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, group = in_compute_dtype(x), self.ctx.tp.group
        if self.ctx.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, self.bias, group, self.recipe)
        return gemm.linear(copy_to_tp(x, group), self.weight, self.bias, recipe=self.recipe)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split; the partial outputs are summed
    (all-reduce, or reduce-scatter along the sequence under SP), then the full bias is added."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, bias: bool) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, ctx.tp.size, "input features")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.placements = {"weight": Placement.split("tp", 1)}
        self.recompute_bias = False  # the bias after the reduction keeps nothing and hands its gradient to W
        self.recipe = gemm.HIGH_PRECISION
        self.operand_splits = ctx.operand_splits(in_="tp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.ctx.tp
        if tp.size == 1:
            return gemm.linear(x, self.weight, self.bias, recipe=self.recipe)
        y = gemm.linear(x, self.weight, recipe=self.recipe)
        y = reduce_scatter_to_sp(y, tp.group) if self.ctx.sequence_parallel else reduce_from_tp(y, tp.group)
        if self.bias is None:
            return y
        return recomputed(add_bias, y, self.bias) if self.recompute_bias else add_bias(y, self.bias)


class DuplicatedLinear(nn.Module):
    """y = x A^T, A whole on every tensor-parallel rank, on this rank's rows of x (its slice of the sequence under
    SP, else every row, as every rank has them): the small down-projections of latent attention, whose outputs
    then enter column-parallel layers. No communication; the column-parallel layer after it brings the output
    gradient whole (all-reduced), or under SP reduce-scatters it to this rank's rows, whose weight gradient is then
    partial over tp, as its placement says (Megatron-Core's "duplicated" linear). Its tokens are split over the
    sequence ranks (tp under SP, and cp), so an FP8 scale spanning them is agreed over those ranks."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.placements = {"weight": default_placement(ctx.sequence_parallel)}
        self.recipe = gemm.HIGH_PRECISION
        self.operand_splits = ctx.operand_splits(tokens="sequence")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, recipe=self.recipe)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up the tokens it owns and the
    partial results are summed (reduce-scattered along the sequence under SP). Without a weight of its own
    (`owns_weight` false) it looks up in the table its forward is handed (multi-token prediction reads the word
    embeddings, or the tied head's copy of them, this way)."""

    def __init__(self, num_embeddings: int, dim: int, ctx: ParallelContext, owns_weight: bool = True) -> None:
        super().__init__()
        self.ctx = ctx
        self.per_rank = _divide(num_embeddings, ctx.tp.size, "padded vocabulary size")
        self.start = ctx.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim)) if owns_weight else None
        self.placements = {"weight": Placement.split("tp", 0)}

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [seq, batch] -> [seq (/tp under SP), batch, dim]; `weight`: the table, when it owns none."""
        tp, weight = self.ctx.tp, self.weight if weight is None else weight
        if tp.size == 1:
            return embedding(tokens, weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(out, tp.group) if self.ctx.sequence_parallel else reduce_from_tp(out, tp.group)
