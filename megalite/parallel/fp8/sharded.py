"""The amax of FP8 scales agreed over the ranks a layout spreads one operand over, so that every layout computes
the one device's scales bit for bit.

One device quantises each matmul operand of a micro batch as one tensor (quantize.py). A layout holds parts of
it on several ranks: a tensor-parallel layer's weight, split along its output features (column-parallel) or its
input features (row-parallel; then also x, and the contraction of the forward); the output gradient of a
column-parallel layer (split along its features, the contraction of the input gradient); a context-parallel
rank's chunks of the tokens (the rows of x and grad, and the contraction of the weight gradient); an expert's
weight split over expert-tensor-parallel ranks; an expert's tokens over the sequence ranks when every rank runs
every expert on its own part of the sequences. The layer declares which axis splits its weight's dimensions
and its tokens (gemm.OperandSplits); here a tile that spans a split dimension (a tensorwise tile spans both,
a rowwise tile its contraction) has its amax reduced by MAX over the ranks along that axis, one all-reduce over
the group of all the axes it spans (tp and cp together where both), on the device (no host read). A tile of
fixed size (blockwise's 1 x 128 and 128 x 128) lies on one rank: the validator makes every rank's share whole
tiles (config_fp8.py), so nothing is reduced.

What needs nothing: sequence parallelism gathers a column-parallel layer's input (and a row-parallel layer's
output gradient) before the matmul, so the whole token dimension is there; pipeline stages hold whole layers;
data-parallel ranks (and ZeRO's slices, gathered whole before a matmul) each run micro batches of their own,
quantised on their own as one device's micro batches are; an expert's tokens are gathered on its rank where the
expert ranks span the sequence ranks.

Every rank along an axis runs the same layers in the same order with the same recipe, so each all-reduce is
posted by all its ranks in the same order (the NCCL rule; tests/test_fp8_layouts.py replays it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.fp8.quantize import Matmul, Operand
from megalite.parallel.gemm import OperandSplits

AXIS_ORDER = ("tp", "cp", "etp", "sequence")  # the order OperandSplits.groups' keys list their axes in


class ShardedAmax:
    """quantize.AmaxReduction for a layer whose operands lie as `splits` says."""

    def __init__(self, splits: OperandSplits) -> None:
        self.splits = splits

    def __call__(self, amax: torch.Tensor, operand: Operand, matmul: Matmul,
                 whole: tuple[bool, bool]) -> torch.Tensor:
        axes = self.spanned(operand, matmul, whole)
        if axes:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.splits.groups[axes])
        return amax

    def spanned(self, operand: Operand, matmul: Matmul, whole: tuple[bool, bool]) -> tuple[str, ...]:
        """The axes that split a dimension of `operand` a tile spans whole, in AXIS_ORDER."""
        split = {axis for axis, spans in zip(self.splits.axes(operand, matmul), whole) if axis and spans}
        return tuple(axis for axis in AXIS_ORDER if axis in split)

    def __repr__(self) -> str:
        return f"ShardedAmax({self.splits!r})"
