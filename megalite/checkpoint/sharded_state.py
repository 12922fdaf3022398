"""Model and optimizer state as pieces of global tensors: what this rank writes, and how a rank
of any other layout reads back what it holds.

Each piece is a flat element range of one shard of a global (one-device) tensor, described by
the global name and shape, the shard (each split of the parameter's placement as [dim, blocks,
index, count], parallel/placement.py) and the range. That is exactly what a rank holds: its shard,
and under the distributed optimizer a flat slice of it, which is not a rectangular box of
the global tensor, so we describe pieces this way instead of with box offsets (and store them
with safetensors + a JSON index rather than torch.distributed.checkpoint, whose planner wants
boxes and whose metadata is pickled). Loading reads, of each tensor, only the new rank's shard
and range (reader.py), so tp, pp, vp, dp and the distributed optimizer may all differ between
save and load. Which rank writes which element is the placement's `counted` rule: each once.

Kinds of piece per parameter: `model` (in the parameter's dtype), `main_param` (fp32 main
weights when parameters are bf16/fp16), Adam's `exp_avg`, `exp_avg_sq` and `step`, or for the matrices Muon
steps (optim.optimizer=muon) its `momentum_buffer`, in the same owned slices, so it too resumes at any layout.
The model's persistent buffers (a router's expert bias: state that training moves without gradients) are `model`
pieces too, whole, written once by the first rank along every axis (they are replicated, like an undeclared
parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megalite.checkpoint.reader import CheckpointReader, Target
from megalite.parallel.distributed_optimizer import DistributedOptimizer
from megalite.parallel.placement import Placement
from megalite.parallel.topology import Topology

ADAM = ("exp_avg", "exp_avg_sq")
MUON = ("momentum_buffer",)
MOMENTS = ADAM + MUON  # per-element optimizer state, of whichever update rule steps the parameter
MAIN = "main_param"


@dataclass
class Piece:
    name: str
    kind: str
    shape: list[int]
    shard: list[list[int]] | None  # its splits, each [dim, blocks, index, count]; None: the whole tensor
    lo: int
    hi: int

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class Entry:
    """One stepped tensor: the model parameter, its stored (global) name, and what the optimizer steps."""

    local: str
    stored: str
    param: nn.Parameter
    main: torch.Tensor
    weights: torch.Tensor  # where the stepped elements of the parameter are stored (flat)
    index: int  # position among the optimizer's parameters
    lo: int
    hi: int
    placement: Placement


class ShardedState:
    def __init__(self, model: nn.Module, optimizer: DistributedOptimizer, placements: dict[str, Placement],
                 topology: Topology) -> None:
        """What this rank holds of the model, and what `optimizer` steps of it (its `shards()`: whole
        parameters or fp32 copies, or flat slices under the distributed optimizer)."""
        self.optimizer, self.placements, self.topology = optimizer.optimizer, placements, topology
        copies = model.tied_copies()
        order = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        self.distributed = optimizer.distributed
        self.muon = {id(p) for g in self.optimizer.param_groups if g.get("muon") for p in g["params"]}
        self.optimizer_name = "muon" if self.muon else "adamw"
        # Every parameter, also those whose optimizer shard another data-parallel rank owns (not stepped here).
        self.params = [(n, copies.get(n, n), p) for n, p in model.named_parameters()]
        self.entries = [Entry(m.name, copies.get(m.name, m.name), m.param, m.main, m.weights, order[id(m.main)],
                              m.start, m.end, placements[m.name]) for m in optimizer.shards()]
        persistent = model.state_dict().keys()
        self.buffers = {name: buffer for name, buffer in model.named_buffers() if name in persistent}

    def _global_shape(self, local: str, param: nn.Parameter) -> list[int]:
        placement = self.placements[local]
        return placement.global_shape(param.shape, self.topology.placement_coord(placement.grid))

    def _shards(self, placement: Placement) -> list[list[int]]:
        return placement.pieces(self.topology.placement_coord(placement.grid))

    def shapes(self) -> dict[str, list[int]]:
        """Global shapes of every parameter this rank holds (whoever owns its optimizer shard), by stored name."""
        return {stored: self._global_shape(local, param) for local, stored, param in self.params}

    def _writes(self, entry: Entry) -> bool:
        """Each element is written once (placement.counted): by the first rank along every axis the parameter
        is replicated over (or, under the distributed optimizer, every data-parallel rank its own range);
        tied copies by their owner."""
        p = entry.placement
        return p.counted(self.topology.axes(p.grid), self.distributed, self.topology.placement_coord(p.grid))

    def pieces(self) -> list[tuple[Piece, torch.Tensor]]:
        """This rank's pieces and their tensors (views of live state: copy before training continues)."""
        out = []
        for e in self.entries:
            if not self._writes(e):
                continue
            where = self._shards(e.placement) or None
            shape = self._global_shape(e.local, e.param)

            def add(kind: str, tensor: torch.Tensor, lo: int = e.lo, hi: int = e.hi, shape: list[int] = shape,
                    where=where, stored: str = e.stored) -> None:
                out.append((Piece(stored, kind, shape, where, lo, hi), tensor.detach().reshape(-1)))

            add("model", e.weights)
            if e.main.dtype != e.param.dtype:
                add(MAIN, e.main)
            state = self.optimizer.state.get(e.main, {})
            for kind in MOMENTS:
                if kind in state:
                    add(kind, state[kind])
            if "step" in state and e.lo == 0 and not any(split[2] for split in where or []):  # one per parameter
                add("step", torch.as_tensor(state["step"], dtype=torch.float32), 0, 1, [1], None)
        if Placement().counted(self.topology.axes(), False, self.topology.placement_coord()):
            out += [(Piece(name, "model", list(b.shape), None, 0, b.numel()), b.detach().reshape(-1))
                    for name, b in self.buffers.items()]
        return out

    def load(self, reader: CheckpointReader, load_optimizer: bool = True) -> bool:
        """Load what this rank steps (under the distributed optimizer only its own slices: the rest of each
        parameter comes from the parameter all-gather afterwards) and, unless `load_optimizer` is false,
        Adam's state. Returns whether optimizer state was loaded: False for a weights-only checkpoint;
        a checkpoint with only part of it is refused."""
        for e in self.entries:
            target = self._target(e)
            values = reader.read_part(e.stored, MAIN, target)
            values = reader.read_part(e.stored, "model", target) if values is None else values
            e.main.data.copy_(values.view_as(e.main))
            e.weights.copy_(values)
        for name, buffer in self.buffers.items():  # a checkpoint without one (an HF model's) keeps the initial value
            values = reader.read_part(name, "model", Target(tuple(buffer.shape), (), 0, buffer.numel()))
            if values is not None:
                buffer.copy_(values.view_as(buffer))
        if not load_optimizer or not reader.kinds() & {*MOMENTS, "step"}:
            return False
        state: dict[int, dict[str, torch.Tensor]] = {}
        for e in self.entries:
            muon = id(e.main) in self.muon
            values = {kind: reader.read_part(e.stored, kind, self._target(e)) for kind in (MUON if muon else ADAM)}
            if not muon:
                values["step"] = reader.read_part(e.stored, "step", Target((1,), (), 0, 1))
            missing = [kind for kind, value in values.items() if value is None]
            if missing:
                raise ValueError(f"checkpoint {reader.path} has optimizer state, but not {', '.join(missing)} of "
                                 f"{e.stored}: saved by another optimizer (optim.optimizer={self.optimizer_name} "
                                 "here, each matrix Muon's or AdamW's) or implementation, whose state would restart "
                                 "silently; pass --checkpoint.load_optimizer=false to resume the weights with fresh "
                                 "optimizer state")
            state[e.index] = {kind: value.view_as(e.main) if kind != "step" else value.reshape(())
                              for kind, value in values.items()}
        current = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
        return True

    def _target(self, entry: Entry) -> Target:
        """The slice of the global tensor that `entry` steps: this rank's shard, its stepped flat range."""
        shards = tuple(tuple(split) for split in self._shards(entry.placement))
        return Target(tuple(self._global_shape(entry.local, entry.param)), shards, entry.lo, entry.hi)
