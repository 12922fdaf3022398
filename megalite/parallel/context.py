"""What the model's layers know of the parallel layout, handed to them as one object.

The model is written once, for every layout: its layers ask this context for the group, rank and size of
the axes they split along (tensor and context parallelism; expert and expert-tensor parallelism on the expert grid),
the ranks that share each sequence of a micro batch (a router's load counts span them), whether sequence
parallelism is on, and which RNG stream their dropout draws from. Nothing else of the topology reaches the
model, and a model built without one (`ParallelContext()`) is the one-device model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.distributed as dist

from megalite.parallel.gemm import OperandSplits
from megalite.parallel.random import RNGTracker, model_parallel_tracker
from megalite.parallel.topology import Topology


@dataclass(frozen=True)
class AxisView:
    """One grid axis as a layer sees it: the group of ranks along it, this rank's index and the size."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1


@dataclass
class ParallelContext:
    tp: AxisView = field(default_factory=AxisView)
    cp: AxisView = field(default_factory=AxisView)
    sequence_parallel: bool = False  # norms, dropout and the residual stream split along the sequence over tp
    cp_comm: str = "p2p"  # how context-parallel attention sees the other ranks' keys and values
    rng: RNGTracker | None = None
    ep: AxisView = field(default_factory=AxisView)  # expert parallelism (the expert grid's ep axis)
    etp: AxisView = field(default_factory=AxisView)  # expert tensor parallelism (its etp axis)
    ep_etp: AxisView = field(default_factory=AxisView)  # the etp x ep ranks that together hold every expert
    sequence_ranks: AxisView = field(default_factory=AxisView)  # ranks holding parts of each sequence (tp under SP, cp)
    expert_dispatcher: str = "alltoall"  # how tokens reach their experts' ranks (parallel.moe_dispatcher)
    tp_cp: AxisView = field(default_factory=AxisView)  # the tp x cp ranks (an FP8 scale may span both)
    experts_see_whole_sequences: bool = True  # the etp x ep ranks include every rank of sequence_ranks

    @classmethod
    def from_topology(cls, topology: Topology, sequence_parallel: bool, seed: int, cp_comm: str = "p2p",
                      expert_dispatcher: str = "alltoall") -> ParallelContext:
        """`sequence_parallel`: ParallelConfig.sequence_parallel_active (asked for, and tp > 1)."""
        ep = etp = ep_etp = AxisView()
        if "expert" in topology.grids:
            ep, etp, ep_etp = (AxisView(topology.group(*axes, grid="expert"), topology.coord(*axes, grid="expert"),
                                        topology.size(*axes, grid="expert")) for axes in (("ep",), ("etp",),
                                                                                          ("etp", "ep")))
        axes = (("tp",) if sequence_parallel else ()) + (("cp",) if topology.cp > 1 else ())
        sequence_ranks = AxisView()
        if axes:
            sequence_ranks = AxisView(topology.group(*axes), topology.coord(*axes), topology.size(*axes))
        tp_cp = AxisView(topology.group("tp", "cp"), topology.coord("tp", "cp"), topology.size("tp", "cp"))
        return cls(AxisView(topology.tp_group, topology.tp_rank, topology.tp),
                   AxisView(topology.cp_group, topology.cp_rank, topology.cp), sequence_parallel, cp_comm,
                   model_parallel_tracker(seed, topology.tp_rank, topology.device), ep, etp, ep_etp,
                   sequence_ranks, expert_dispatcher, tp_cp, _experts_see_whole_sequences(topology, axes))

    @classmethod
    def tensor_parallel(cls, group: dist.ProcessGroup | None, rank: int, size: int,
                        sequence_parallel: bool = False) -> ParallelContext:
        """Tensor parallelism alone (tests and benchmarks of single layers)."""
        return cls(AxisView(group, rank, size), sequence_parallel=sequence_parallel)

    def operand_splits(self, out: str | None = None, in_: str | None = None, experts: bool = False,
                       tokens: str = "cp") -> OperandSplits:
        """Where a matmul layer's operands lie (gemm.OperandSplits): its weight split along its output (`out`) or
        input features (`in_`) over that axis ("tp" or "etp"); a dense layer's tokens over the `tokens` axis: cp
        for a tensor-parallel layer (sequence parallelism gathers them whole over tp before its matmuls), the
        sequence ranks ("sequence") for a layer whole on every rank that runs on the rank's own rows (latent
        attention's down-projections, parallel/layers.py DuplicatedLinear); an expert's over the sequence ranks when
        each rank runs every expert on its own tokens (ep = etp = 1). Where the expert ranks gather every part
        of a sequence the tokens are whole; where they gather some parts and not others (ep over part of the
        sequence ranks) an expert's scales follow the tokens its rank holds, not one device's. Axes of one
        rank split nothing."""
        views = {"tp": self.tp, "cp": self.cp, "etp": self.etp, "sequence": self.sequence_ranks}
        groups = {(axis,): view.group for axis, view in views.items() if view.size > 1}
        if self.tp.size > 1 and self.cp.size > 1:
            groups[("tp", "cp")] = self.tp_cp.group
        if experts:
            tokens = "sequence" if self.ep_etp.size == 1 and not self.experts_see_whole_sequences else None
        live = [axis if axis is not None and views[axis].size > 1 else None for axis in (out, in_, tokens)]
        return OperandSplits(*live, groups)

    def coord(self, axis: str) -> tuple[int, int]:
        """(this rank's index, the size) along a grid axis the model splits along."""
        view = getattr(self, axis)
        return view.rank, view.size

    def region_rng(self) -> contextlib.AbstractContextManager:
        """RNG for dropout on activations that differ across TP ranks (their own heads or sequence slice)."""
        return self.rng.fork() if self.rng is not None and self.tp.size > 1 else contextlib.nullcontext()

    def hidden_rng(self) -> contextlib.AbstractContextManager:
        """RNG for dropout on the hidden stream: sharded (own stream) only under sequence parallelism."""
        return self.region_rng() if self.sequence_parallel else contextlib.nullcontext()


def _experts_see_whole_sequences(topology: Topology, sequence_axes: tuple[str, ...]) -> bool:
    """Whether this rank's expert-tensor-and-expert-parallel ranks include all its sequence ranks (the ranks
    holding parts of its micro batch's sequences): then each expert's tokens of a micro batch reach its rank."""
    if not sequence_axes or "expert" not in topology.grids:
        return True
    mine = (ranks for ranks in topology.grids["dense"].groups(sequence_axes) if topology.rank in ranks)
    experts = (ranks for ranks in topology.grids["expert"].groups(("etp", "ep")) if topology.rank in ranks)
    return set(next(mine)) <= set(next(experts))
