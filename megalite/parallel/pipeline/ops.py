"""What a pipeline schedule is made of: operations on (model chunk, micro batch).

A schedule is the list of operations each pipeline rank performs, in order: the forward (F), the backward (B)
or the weight gradient (W) of one of its chunks for one micro batch. The types here are what every part of the
pipeline speaks: the schedules' op-list builders, the communication plan, the executor and the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import NamedTuple


class OpKind(str, Enum):
    """What an operation computes. F: a chunk's forward; B: its backward, input and weight gradients
    together, unless the schedule has W operations: then B computes the input gradients only (what the
    previous rank waits for) and W, later, the weight gradients of that chunk and micro batch
    (weight_grads.py); W consumes and sends no message."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:  # "F", not "OpKind.F", in traces and messages
        return self.value


class Op(NamedTuple):
    """One operation of a rank's schedule; equal to the plain tuple ("F", chunk, microbatch)."""

    kind: OpKind
    chunk: int
    microbatch: int


F, B, W = OpKind.F, OpKind.B, OpKind.W
OpList = Callable[[int, int, int, int], list[Op]]  # (pp, vp, rank, microbatches) -> the rank's ops in order
# (pp, vp, microbatches, T_F, T_B, T_W) -> idle share of the ideal step m (T_F + T_B + T_W); T: a rank's whole stage
Bubble = Callable[[int, int, int, float, float, float], float]
