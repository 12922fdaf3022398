"""Tensor-parallel layers (Megatron-LM's column/row scheme) and how their weights are sharded.

A ColumnParallelLinear splits its output features across the TP group, a RowParallelLinear
its input features, a VocabParallelEmbedding the vocabulary rows. Each layer declares its
sharded parameters in `shard_specs`, so initialisation, gradient-norm accounting and
checkpoints can move between full tensors and per-rank shards without knowing the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.parallel.mappings import (copy_to_tp, in_compute_dtype, reduce_from_tp, reduce_scatter_to_sp,
                                       sequence_parallel_linear)
from megalite.parallel.random import RNGTracker, model_parallel_tracker
from megalite.parallel.topology import Topology


@dataclass(frozen=True)
class ShardSpec:
    """Split along `dim`; the full tensor is `blocks` equal sub-matrices along dim (SwiGLU's gate
    and up), each split across ranks, so every rank holds matching slices of each block."""

    dim: int
    blocks: int = 1


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    parts = full.chunk(spec.blocks, spec.dim)
    return torch.cat([p.chunk(size, spec.dim)[rank] for p in parts], spec.dim)


def unshard(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of shard: the full tensor from every rank's shard, in rank order."""
    blocks = [torch.cat([s.chunk(spec.blocks, spec.dim)[b] for s in shards], spec.dim) for b in range(spec.blocks)]
    return torch.cat(blocks, spec.dim)


@dataclass
class TPContext:
    """What a layer needs to know about its tensor-parallel group."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False
    rng: RNGTracker | None = None

    @classmethod
    def from_topology(cls, topology: Topology, sequence_parallel_active: bool, seed: int) -> "TPContext":
        """`sequence_parallel_active`: ParallelConfig.sequence_parallel_active (asked for, and tp > 1)."""
        tracker = model_parallel_tracker(seed, topology.tp_rank, topology.device)
        return cls(topology.tp_group, topology.tp_rank, topology.tp, sequence_parallel_active, tracker)

    def region_rng(self) -> contextlib.AbstractContextManager:
        """RNG for dropout on activations that differ across TP ranks (their own heads or sequence slice)."""
        return self.rng.fork() if self.rng is not None and self.size > 1 else contextlib.nullcontext()

    def hidden_rng(self) -> contextlib.AbstractContextManager:
        """RNG for dropout on the hidden stream: sharded (own stream) only under sequence parallelism."""
        return self.region_rng() if self.sequence_parallel else contextlib.nullcontext()


@dataclass(frozen=True)
class CPContext:
    """What attention needs to know about its context-parallel group (size 1: no context parallelism)."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    comm: str = "p2p"

    @classmethod
    def from_topology(cls, topology: Topology, comm: str) -> "CPContext":
        return cls(topology.cp_group, topology.cp, comm)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split across ranks; output stays split."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool, blocks: int = 1) -> None:
        super().__init__()
        self.tp = tp
        local = _divide(out_features, tp.size * blocks, "output features / blocks") * blocks
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        self.shard_specs = {"weight": ShardSpec(0, blocks), "bias": ShardSpec(0, blocks)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = in_compute_dtype(x)
        if self.tp.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, self.bias, self.tp.group)
        return F.linear(copy_to_tp(x, self.tp.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split; the partial outputs are summed
    (all-reduce, or reduce-scatter along the sequence under SP), then the full bias is added."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, tp.size, "input features")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shard_specs = {"weight": ShardSpec(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y, self.tp.group) if self.tp.sequence_parallel else reduce_from_tp(y, self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; each rank looks up the tokens it owns and the
    partial results are summed (reduce-scattered along the sequence under SP)."""

    def __init__(self, num_embeddings: int, dim: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.per_rank = _divide(num_embeddings, tp.size, "padded vocabulary size")
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        self.shard_specs = {"weight": ShardSpec(0)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [seq, batch] -> [seq (/tp under SP), batch, dim]."""
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return (reduce_scatter_to_sp(out, self.tp.group) if self.tp.sequence_parallel
                else reduce_from_tp(out, self.tp.group))


def parameter_shards(model: nn.Module) -> dict[str, ShardSpec]:
    """Name -> ShardSpec of every tensor-parallel parameter; parameters not listed are replicated."""
    specs = {}
    for module_name, module in model.named_modules():
        for attr, spec in getattr(module, "shard_specs", {}).items():
            if getattr(module, attr, None) is not None:
                specs[f"{module_name}.{attr}" if module_name else attr] = spec
    return specs
