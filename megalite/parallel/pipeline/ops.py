"""What a pipeline schedule is made of: operations on (model chunk, micro batch).

A schedule is the list of operations each pipeline rank performs, in order: the forward (F), the backward (B)
or the weight gradient (W) of one of its chunks for one micro batch, or a `Paired` operation: the forward of
one micro batch and the backward of another, run together so that one's communication hides behind the
other's compute (DualPipe's F&B, dualpipe.py; the executor's pair runner, overlap.py). The types here are what
every part of the pipeline speaks: the schedules' op-list builders, the communication plan, the executor and
the planner; each reads an operation through its `parts`, so a paired one is its two parts to all of them
but the executor's pair runner and the cost model (its F&B time).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import NamedTuple, Protocol


class OpKind(str, Enum):
    """What an operation computes. F: a chunk's forward; B: its backward, input and weight gradients
    together, unless the rank's list has a W for the same chunk and micro batch: then B computes the input
    gradients only (what the previous rank waits for) and W, later, the weight gradients (weight_grads.py);
    W consumes and sends no message."""

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

    @property
    def parts(self) -> tuple[Op, ...]:
        return (self,)

    @property
    def label(self) -> str:
        return f"{self.kind} c{self.chunk} mb{self.microbatch}"


FB = "F&B"  # a Paired operation's kind


class Paired(NamedTuple):
    """F&B: the forward of one (chunk, micro batch) and the whole backward (input and weight gradients) of
    another, run together: each part takes its input and sends its output as it would alone, and the pair
    runner (overlap.py) lets one part's communication travel while the other computes."""

    forward: Op
    backward: Op

    kind = FB

    @property
    def parts(self) -> tuple[Op, ...]:
        return (self.forward, self.backward)

    @property
    def label(self) -> str:
        return f"{self.forward.label} & {self.backward.label}"


F, B, W = OpKind.F, OpKind.B, OpKind.W
ScheduleOp = Op | Paired
OpList = Callable[[int, int, int, int], list[ScheduleOp]]  # (pp, vp, rank, microbatches) -> the rank's ops in order


class Bubble(Protocol):
    """(pp, vp, microbatches, T_F, T_B, T_W, T_FB) -> idle share of the ideal step m (T_F + T_B + T_W); T: a rank's
    whole stage (all its chunks), T_FB: a paired forward and whole backward, both chunks' (None: T_F + T_B + T_W,
    nothing hidden)."""

    def __call__(self, pp: int, vp: int, m: int, t_f: float, t_b: float, t_w: float,
                 t_fb: float | None = None) -> float: ...


def weight_gradient_ops(ops: list[ScheduleOp]) -> dict[tuple[int, int], int]:
    """(chunk, micro batch) -> the index of the operation computing its weight gradients: its W, or the B
    (alone or in a pair) where the list has no W for it."""
    deferred = {(op.chunk, op.microbatch) for op in ops if op.kind == W}
    return {(part.chunk, part.microbatch): index for index, op in enumerate(ops) for part in op.parts
            if part.kind == W or (part.kind == B and (part.chunk, part.microbatch) not in deferred)}
