"""Where each parameter lives on the rank grids: the one home of that fact.

A parameter's `Placement` says which grid it lives on (dense, or expert for the experts' weights),
along which of its axes the full (one-device) tensor is split and how (`ShardSpec`, several axes
possible, applied in order), along which axes its gradient is a partial sum (a tensor-parallel-replicated
norm or bias under sequence parallelism saw only its rank's slice of the sequence), and whether it is a
copy of a parameter another pipeline stage holds (tied embeddings). The layer that creates a parameter
declares its placement (`placements = {"weight": Placement(...)}`); undeclared parameters are replicated
(`default_placement`).

Everything that asks where the rest of a tensor is reads it: initialisation slices the full initial
value (model/init.py), gradients are reduced over the grid's data axes and summed over the partial
ones (ddp.py), the gradient norm counts each element once (`counted`), the distributed optimizer
shards over the data axes, checkpoints describe each piece by its shards (checkpoint/sharded_state.py),
the planner counts bytes per rank. A new sharding is a new Placement, not a branch in each of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# For each grid, the axes whose ranks hold the same parameters but see different data: gradients are summed
# over them and the distributed optimizer shards over them. The other axes are model axes (sharded or
# replicated), and pp, along which each parameter lives on one stage.
DATA_AXES = {"dense": ("cp", "dp"), "expert": ("edp",)}

Coord = Callable[[str], tuple[int, int]]  # axis -> (this rank's index along it, the axis's size)


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


@dataclass(frozen=True)
class Fused:
    """How the rows of a fused weight (of each matrix of a stack) are the separate matrices transformers has:
    `periods` repeats of `parts` rows (in proportion), part j of every repeat belonging to matrix j. megalite's
    QKV is (query heads per group, 1, 1) repeated over the KV groups (model/attention.py), SwiGLU's gate/up two
    blocks. With `heads` each unit of a part is one attention head's rows (Muon's per-head option)."""

    periods: int
    parts: tuple[int, ...]
    heads: bool = False

    def matrices(self, rows: int, per_head: bool) -> list[torch.Tensor]:
        """The row indices of each separate matrix of a full weight with `rows` rows (each head's if `per_head`)."""
        unit = rows // (self.periods * sum(self.parts))
        period, split = unit * sum(self.parts), per_head and self.heads
        out, offset = [], 0
        for part in self.parts:
            starts = [p * period + offset for p in range(self.periods)]
            if split:
                out += [torch.arange(s + h * unit, s + (h + 1) * unit) for s in starts for h in range(part)]
            else:
                out.append(torch.cat([torch.arange(s, s + part * unit) for s in starts]))
            offset += part * unit
        return out


@dataclass(frozen=True)
class Placement:
    shards: tuple[tuple[str, ShardSpec], ...] = ()  # (grid axis, how the full tensor splits along it), in order
    grid: str = "dense"
    partial: tuple[str, ...] = ()  # axes whose ranks hold partial sums of its gradient
    copy: bool = False  # a copy of another stage's parameter: its gradient joins the original's; never counted
    fused: Fused | None = None  # the separate matrices of a fused weight (None: blocks of its split, else one)

    @classmethod
    def split(cls, axis: str, dim: int, blocks: int = 1, grid: str = "dense") -> Placement:
        """Split along one axis: what tensor-parallel layers declare."""
        return cls(((axis, ShardSpec(dim, blocks)),), grid)

    def separate_rows(self, shape: torch.Size | list[int], per_head: bool) -> list[torch.Tensor] | None:
        """The row indices of the separate matrices in each (full) matrix of shape [..., rows, cols]: `fused`'s,
        else the blocks its rows are split in (gate/up), else None (one matrix)."""
        rows_dim = len(shape) - 2
        fused = self.fused or next((Fused(1, (1,) * spec.blocks) for _, spec in self.shards
                                    if spec.dim == rows_dim and spec.blocks > 1), None)
        return fused.matrices(shape[rows_dim], per_head) if fused is not None else None

    def local(self, full: torch.Tensor, coord: Coord) -> torch.Tensor:
        """This rank's slice of the full tensor."""
        for axis, spec in self.shards:
            full = shard(full, spec, *coord(axis))
        return full

    def global_shape(self, local_shape: torch.Size | list[int], coord: Coord) -> list[int]:
        shape = list(local_shape)
        for axis, spec in self.shards:
            shape[spec.dim] *= coord(axis)[1]
        return shape

    def pieces(self, coord: Coord) -> list[list[int]]:
        """This rank's shards as checkpoints record them: [dim, blocks, index, count] per split that divides
        the tensor (axes of size 1 leave it whole), in the order they apply."""
        return [[spec.dim, spec.blocks, *coord(axis)] for axis, spec in self.shards if coord(axis)[1] > 1]

    def replicated(self, axes: tuple[str, ...], sharded_data: bool) -> tuple[str, ...]:
        """The axes of its grid (`axes`) along which ranks hold the same elements of it: every axis but the
        sharded ones and pp, and not the data axes when the distributed optimizer shards over them
        (`sharded_data`: each data-parallel rank then owns other elements)."""
        split = {axis for axis, _ in self.shards} | {"pp"} | (set(DATA_AXES[self.grid]) if sharded_data else set())
        return tuple(axis for axis in axes if axis not in split)

    def counted(self, axes: tuple[str, ...], sharded_data: bool, coord: Coord) -> bool:
        """Whether this rank counts its elements (gradient norm) and writes them (checkpoints): each element
        once over the world, by the ranks at coordinate 0 of every axis it is replicated over; copies never."""
        return not self.copy and all(coord(axis)[0] == 0 for axis in self.replicated(axes, sharded_data))


def default_placement(sequence_parallel: bool) -> Placement:
    """An undeclared parameter (norms, row-parallel biases, position embeddings) is whole on every rank. Under
    sequence parallelism each tensor-parallel rank ran it on its slice of the sequence, so its gradient is
    partial over tp."""
    return Placement(partial=("tp",) if sequence_parallel else ())


def parameter_placements(model: nn.Module, sequence_parallel: bool,
                         copies: dict[str, str] | None = None) -> dict[str, Placement]:
    """Every parameter's placement by name: declared by its module (`placements`), else the default; the
    names in `copies` ({copy: original}, tied embeddings) are marked as copies."""
    declared = {}
    for module_name, module in model.named_modules():
        for attr, placement in getattr(module, "placements", {}).items():
            declared[f"{module_name}.{attr}" if module_name else attr] = placement
    default = default_placement(sequence_parallel)
    found = {name: declared.get(name, default) for name, _ in model.named_parameters()}
    for name in copies or {}:
        found[name] = dataclasses.replace(found[name], copy=True)
    return found
