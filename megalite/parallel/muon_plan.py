"""Which rank runs each matrix's Newton-Schulz iteration, and what travels to it and back: Muon's traffic plan.

Muon needs every weight matrix whole, while tensor parallelism splits matrices over tp (etp for experts) and the
distributed optimizer cuts each rank's flat slice of a bucket anywhere (bucket_layout.py). A *unit* is one
matrix of a parameter (each expert of a stack its own) made whole along every axis that splits its matrix
dimensions (the last two; ep splits the stack, so an expert lives at one ep coordinate). Its *holders* are the
ranks of the pipeline stage that hold pieces of it (tp x cp x dp for a dense weight,
etp x edp at one ep coordinate for experts); where each holder's piece sits is read from the placement (its shard)
and the bucket layout (its owned range), identical on every holder, so every rank derives the same plan alone.

Owners are chosen greedily, largest unit first, each to the holder with the least Newton-Schulz work so far (a
matrix's iteration costs about rows x cols x min(rows, cols)), so the work spreads over the stage. A step then
moves, in one all-to-all each way over the world group (ranks of other stages exchange nothing): each piece's
update to its unit's owner (only the holders that write it, placement.counted: each element once), and each
holder's slice of the orthogonalised update back. Every rank calls both, in the same order, so NCCL's rules hold.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel.bucket_layout import BucketLayout
from megalite.parallel.placement import DATA_AXES, Placement, ShardSpec, shard, unshard
from megalite.parallel.topology import RankGrid


@dataclass(frozen=True)
class Piece:
    """Holder `rank`'s part of a unit: its shard (coordinates along the unit's gathered axes), the flat range
    [lo, hi) of it that the rank steps, where that range starts in the rank's stepped slice of the parameter
    (`at`), and whether it sends it (it writes those elements)."""

    rank: int
    shard: tuple[int, ...]
    lo: int
    hi: int
    at: int
    sends: bool


@dataclass
class Unit:
    """One matrix of a parameter (one of a stack: an expert) whole along its gathered axes: `shape` its whole
    shape, `local` a shard's shape; `gathered` the (axis, spec, size) it is split along (spec dims counted in the
    matrix); `stack` how many stack dimensions the parameter has (its placement's dims count them)."""

    key: tuple
    name: str
    placement: Placement
    shape: list[int]
    local: torch.Size
    gathered: list[tuple]
    stack: int
    pieces: list[Piece]
    owner: int = -1

    @property
    def cost(self) -> int:
        rows, cols = self.shape
        return rows * cols * min(rows, cols)

    def separate_rows(self, per_head: bool) -> list[torch.Tensor] | None:
        """The row indices of the separate matrices transformers has in this one (placement.py)."""
        return self.placement.separate_rows([1] * self.stack + self.shape, per_head)

    def assemble(self, parts: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
        """The whole tensor from its flat shards by shard coordinates (inverse of `split`)."""
        shards = {coords: flat.view(self.local) for coords, flat in parts.items()}
        for k in reversed(range(len(self.gathered))):
            _, spec, size = self.gathered[k]
            prefixes = dict.fromkeys(c[:k] for c in shards)
            shards = {p: unshard([shards[p + (i,)] for i in range(size)], spec) for p in prefixes}
        return shards[()]

    def split(self, whole: torch.Tensor, coords: tuple[int, ...]) -> torch.Tensor:
        """The shard at `coords` of the whole tensor, flat."""
        for (_, spec, size), index in zip(self.gathered, coords):
            whole = shard(whole, spec, index, size)
        return whole.reshape(-1)


def owned_by_index(layouts: list[tuple[str, BucketLayout, bool]],
                   names: dict[int, str]) -> dict[str, list[dict[str, tuple[int, int]]]]:
    """By grid, for each data-parallel index, the range of each parameter that index owns (by name), from each
    gradient buffer's (grid, layout, whether the optimizer is sharded): the layouts are the same on every replica,
    so each rank knows what every other one steps (and the planner what every rank of a stage does)."""
    ranges: dict[str, list[dict[str, tuple[int, int]]]] = {}
    for grid, layout, sharded in layouts:
        per_index = ranges.setdefault(grid, [{} for _ in range(layout.replicas)])
        for index, owned in enumerate(per_index):
            owned |= {names[id(p)]: (lo, hi) for p, lo, hi in layout.owned_ranges(index, sharded)}
    return ranges


def _units(name: str, param: torch.Tensor, placement: Placement, grid: RankGrid, stage: list[int],
           ranges: list[dict[int, tuple[int, int]]], distributed: bool) -> list[Unit]:
    """`name`'s units in the stage (`stage`: its ranks), one per matrix (each of a stack its own, whichever ranks
    hold it); `ranges[i]`: data-parallel index i's owned range of the parameter."""
    stack_dims = param.ndim - 2
    splits = [(axis, spec, grid.size(axis)) for axis, spec in placement.shards]
    stack = [axis for axis, spec, _ in splits if spec.dim < stack_dims]
    gathered = [(axis, ShardSpec(spec.dim - stack_dims, spec.blocks), size) for axis, spec, size in splits
                if spec.dim >= stack_dims and size > 1]
    local = param.shape[-2:]
    shape = list(local)
    for _, spec, size in gathered:
        shape[spec.dim] *= size
    units, size = {}, local.numel()
    for rank in stage:
        coords = grid.coords(rank)
        for m in range(math.prod(param.shape[:-2])):
            key = (name, *(coords[axis] for axis in stack), m)
            if key not in units:
                units[key] = Unit(key, name, placement, shape, local, gathered, stack_dims, [])
            owned = ranges[grid.index_in(rank, DATA_AXES[placement.grid])].get(name)
            lo, hi = (max(owned[0], m * size), min(owned[1], (m + 1) * size)) if owned is not None else (0, 0)
            if lo < hi:
                sends = placement.counted(grid.axes, distributed, lambda axis, c=coords: (c[axis], grid.size(axis)))
                units[key].pieces.append(Piece(rank, tuple(coords[axis] for axis, _, _ in gathered), lo - m * size,
                                               hi - m * size, lo - owned[0], sends))
    return list(units.values())


def balance(units: list[Unit]) -> None:
    """Give each unit an owner among its holders: largest first, to the least loaded (ties: the lowest rank)."""
    load: dict[int, int] = {}
    for unit in sorted(units, key=lambda u: (-u.cost, u.key)):
        holders = sorted({p.rank for p in unit.pieces})
        unit.owner = min(holders, key=lambda r: (load.get(r, 0), r))
        load[unit.owner] = load.get(unit.owner, 0) + unit.cost


class MuonPlan:
    """The units of this rank's stage and the step's two exchanges. `params`: (name, parameter, placement) of
    every Muon parameter this rank holds; `ranges[grid][i]`: by name, the owned range of data-parallel index i."""

    def __init__(self, params: list[tuple[str, torch.Tensor, Placement]], grids: dict[str, RankGrid], rank: int,
                 ranges: dict[str, list[dict[int, tuple[int, int]]]], distributed: bool) -> None:
        self.rank, self.world = rank, grids["dense"].world_size
        dense = grids["dense"]
        stage = next(r for r in dense.groups(tuple(a for a in dense.axes if a != "pp")) if rank in r)
        self.units = [u for name, param, placement in params for u in _units(
            name, param, placement, grids[placement.grid], stage, ranges[placement.grid], distributed)]
        balance(self.units)
        self.units.sort(key=lambda u: u.key)
        self.mine = [(u, p) for u in self.units for p in u.pieces if p.rank == rank]  # what this rank steps
        self.routes = {back: self._route(back) for back in (False, True)}

    def _route(self, back: bool) -> tuple[list, list, list[int], list[int]]:
        """One direction's transfers, planned once: what this rank sends (by destination) and receives (by source),
        each (source, destination, unit, piece) in the one order all ranks use, and the split sizes."""
        moves = []
        for unit in self.units:
            for piece in unit.pieces:
                if back:
                    moves.append((unit.owner, piece.rank, unit, piece))
                elif piece.sends:
                    moves.append((piece.rank, unit.owner, unit, piece))
        out = sorted((m for m in moves if m[0] == self.rank), key=lambda m: m[1])
        into = sorted((m for m in moves if m[1] == self.rank), key=lambda m: m[0])
        sizes = [[sum(m[3].hi - m[3].lo for m in ms if m[end] == r) for r in range(self.world)]
                 for ms, end in ((out, 1), (into, 0))]
        return out, into, *sizes

    def _exchange(self, back: bool, payload: dict, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Send payload[(unit key, piece rank)] of each planned transfer from this rank; returns what arrives, in
        the order of the direction's `into`."""
        out, into, sent_sizes, received_sizes = self.routes[back]
        sent = [payload[(m[2].key, m[3].rank)].to(device, dtype) for m in out]
        flat = torch.cat(sent) if sent else torch.empty(0, dtype=dtype, device=device)
        received = torch.empty(sum(received_sizes), dtype=dtype, device=device)
        if self.world == 1:
            received.copy_(flat)
        else:
            dist.all_to_all_single(received, flat, received_sizes, sent_sizes)
        return list(received.split([m[3].hi - m[3].lo for m in into]))

    def gather(self, updates: dict[str, torch.Tensor], dtype: torch.dtype,
               device: torch.device) -> dict[tuple, torch.Tensor]:
        """Each owned unit whole, from every holder's flat piece (`updates`, by name: this rank's)."""
        payload = {(u.key, p.rank): updates[u.name][p.at:p.at + p.hi - p.lo] for u, p in self.mine}
        parts: dict[tuple, dict[tuple[int, ...], torch.Tensor]] = {}
        for (_, _, unit, piece), values in zip(self.routes[False][1], self._exchange(False, payload, dtype, device)):
            shards = parts.setdefault(unit.key, {})
            flat = shards.setdefault(piece.shard, torch.zeros(unit.local.numel(), dtype=dtype, device=device))
            flat[piece.lo:piece.hi] = values
        whole = {}
        for unit in self.units:
            if unit.owner == self.rank:
                coords = itertools.product(*(range(size) for _, _, size in unit.gathered))
                shards = {c: parts.get(unit.key, {}).get(c, torch.zeros(unit.local.numel(), dtype=dtype,
                                                                       device=device)) for c in coords}
                whole[unit.key] = unit.assemble(shards)
        return whole

    def scatter(self, results: dict[tuple, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Every holder's stepped slice of each parameter's result (`results`: this rank's owned units, whole), by
        name, put together from its units' pieces."""
        payload = {}
        for unit in self.units:
            if unit.owner == self.rank:
                shards = {c: unit.split(results[unit.key], c) for c in dict.fromkeys(p.shard for p in unit.pieces)}
                for piece in unit.pieces:
                    payload[(unit.key, piece.rank)] = shards[piece.shard][piece.lo:piece.hi]
        arrived = self._exchange(True, payload, torch.float32, device)
        lengths: dict[str, int] = {}
        for unit, piece in self.mine:
            lengths[unit.name] = max(lengths.get(unit.name, 0), piece.at + piece.hi - piece.lo)
        out = {name: torch.empty(length, device=device) for name, length in lengths.items()}
        for (_, _, unit, piece), values in zip(self.routes[True][1], arrived):
            out[unit.name][piece.at:piece.at + piece.hi - piece.lo] = values
        return out
