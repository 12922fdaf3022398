"""Model and optimizer state as pieces of global tensors: what this rank writes, and how a rank
of any other layout reads back what it holds.

Each piece is a flat element range of one tensor-parallel shard of a global (one-device)
tensor, described by the global name and shape, the shard (dim, blocks, index, count; see
parallel/layers.py ShardSpec) and the range. That is exactly what a rank holds: a TP shard,
and under the distributed optimizer a flat slice of it, which is not a rectangular box of
the global tensor, so we describe pieces this way instead of with box offsets (and store them
with safetensors + a JSON index rather than torch.distributed.checkpoint, whose planner wants
boxes and whose metadata is pickled). Loading reads, of each tensor, only the new rank's shard
and range (reader.py), so tp, pp, vp, dp and the distributed optimizer may all differ between
save and load.

Kinds of piece per parameter: `model` (in the parameter's dtype), `main_param` (fp32 main
weights when parameters are bf16/fp16), Adam's `exp_avg`, `exp_avg_sq` and `step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megalite.checkpoint.reader import CheckpointReader, Target
from megalite.parallel.distributed_optimizer import DistributedOptimizer
from megalite.parallel.layers import ShardSpec, TPContext, parameter_shards
from megalite.parallel.topology import Topology

MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN = "main_param"


@dataclass
class Piece:
    name: str
    kind: str
    shape: list[int]
    shard: list[int] | None  # [dim, blocks, index, count]
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
    tied_copy: bool  # a copy of another stage's parameter (tied embeddings): saved by the owner


class ShardedState:
    def __init__(self, model: nn.Module, optimizer: DistributedOptimizer, tp: TPContext, topology: Topology) -> None:
        """What this rank holds of the model, and what `optimizer` steps of it (its `shards()`: whole
        parameters or fp32 copies, or flat slices under the distributed optimizer)."""
        self.optimizer, self.tp, self.topology = optimizer.optimizer, tp, topology
        self.specs = parameter_shards(model)
        copies = model.tied_copies()
        order = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        self.distributed = optimizer.distributed
        # Every parameter, also those whose optimizer shard another data-parallel rank owns (not stepped here).
        self.params = [(n, copies.get(n, n), p) for n, p in model.named_parameters()]
        self.entries = [Entry(m.name, copies.get(m.name, m.name), m.param, m.main, m.weights, order[id(m.main)],
                              m.start, m.end, m.name in copies) for m in optimizer.shards()]

    def _spec(self, local: str) -> ShardSpec | None:
        return self.specs.get(local) if self.tp.size > 1 else None

    def _global_shape(self, local: str, param: nn.Parameter) -> list[int]:
        shape, spec = list(param.shape), self._spec(local)
        if spec is not None:
            shape[spec.dim] *= self.tp.size
        return shape

    def shapes(self) -> dict[str, list[int]]:
        """Global shapes of every parameter this rank holds (whoever owns its optimizer shard), by stored name."""
        return {stored: self._global_shape(local, param) for local, stored, param in self.params}

    def _writes(self, entry: Entry) -> bool:
        """Each element is written once: TP-replicated tensors by TP rank 0, DP replicas by DP rank 0
        (or, under the distributed optimizer, every DP rank its own range), tied copies by their owner.
        Context-parallel ranks are replicas like DP ranks."""
        t = self.topology
        replicated_tp = self._spec(entry.local) is None and t.tp_rank != 0
        return not entry.tied_copy and not replicated_tp and (self.distributed or t.dp_cp_rank == 0)

    def pieces(self) -> list[tuple[Piece, torch.Tensor]]:
        """This rank's pieces and their tensors (views of live state: copy before training continues)."""
        out = []
        for e in self.entries:
            if not self._writes(e):
                continue
            spec = self._spec(e.local)
            where = [spec.dim, spec.blocks, self.tp.rank, self.tp.size] if spec else None
            shape = self._global_shape(e.local, e.param)

            def add(kind: str, tensor: torch.Tensor, lo: int = e.lo, hi: int = e.hi, shape: list[int] = shape,
                    where=where) -> None:
                out.append((Piece(e.stored, kind, shape, where, lo, hi), tensor.detach().reshape(-1)))

            add("model", e.weights)
            if e.main.dtype != e.param.dtype:
                add(MAIN, e.main)
            state = self.optimizer.state.get(e.main, {})
            for kind in MOMENTS:
                if kind in state:
                    add(kind, state[kind])
            if "step" in state and e.lo == 0 and self.tp.rank == 0:  # one scalar per parameter
                add("step", torch.as_tensor(state["step"], dtype=torch.float32), 0, 1, [1], None)
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
        if not load_optimizer or not reader.kinds() & {*MOMENTS, "step"}:
            return False
        state: dict[int, dict[str, torch.Tensor]] = {}
        for e in self.entries:
            values = {kind: reader.read_part(e.stored, kind, self._target(e)) for kind in MOMENTS}
            values["step"] = reader.read_part(e.stored, "step", Target((1,), None, 0, 1))
            missing = [kind for kind, value in values.items() if value is None]
            if missing:
                raise ValueError(f"checkpoint {reader.path} has optimizer state, but not {', '.join(missing)} of "
                                 f"{e.stored} (saved by another optimizer implementation?): Adam would restart "
                                 "silently; pass --checkpoint.load_optimizer=false to resume the weights with fresh "
                                 "optimizer state")
            state[e.index] = ({kind: values[kind].view_as(e.main) for kind in MOMENTS}
                              | {"step": values["step"].reshape(())})
        current = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
        return True

    def _target(self, entry: Entry) -> Target:
        """The slice of the global tensor that `entry` steps: this rank's TP shard, its stepped flat range."""
        spec = self._spec(entry.local)
        shard = (spec.dim, spec.blocks, self.tp.rank, self.tp.size) if spec else None
        return Target(tuple(self._global_shape(entry.local, entry.param)), shard, entry.lo, entry.hi)
