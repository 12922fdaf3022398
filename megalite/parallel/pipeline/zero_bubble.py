"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241).

Each backward is split into B, the input gradient the previous rank waits for, and W, the weight gradient
nothing waits for (weight_grads.py), and the W operations go where 1F1B idles. Per micro batch a rank still
runs F, B and W once per chunk; only their order changes, so the communication plan (plan.py), the NCCL-rule
replay and the executor (executor.py) are those of every schedule.

- `zb-h1` (ZB-H1): the 1F1B order (interleaved 1F1B's when vp > 1), each backward split in two, and rank
  r's W operations each deferred by as many backwards as its warm-up is shorter than rank 0's. Every rank
  then holds what 1F1B's rank 0 holds (micro batches between their forward and their weight gradient), and
  the deferred W operations fill the cool-down, where 1F1B's later ranks wait for gradients. With vp > 1
  this is the interleaved zero-bubble order, on the interleaved schedule's memory.
- `zb-v` (ZB-V, vp = 2, the V chunk order of stage.py): rank r holds chunks r and 2pp-1-r. Its
  warm-up runs 2(pp-r)-1 forwards of its first chunk, then r pairs of forwards of both chunks: exactly the
  forwards whose inputs arrive (unit times) before its first backward does; then the steady phase runs
  F, B, W of one chunk and of the other in turn; the cool-down runs the remaining backwards first and the
  weight gradients last. At most 2 pp chunk forwards are in flight on any rank: 1F1B's rank 0's pp stages.

Both orders are fixed, not found by simulating one set of operation times: lists fitted to equal F, B and
W times were found to idle badly when B took twice F, where these stay within the formulas below.

The bubble (each spec's formula, the idle share of the ideal step m (T_F + T_B + T_W), with T the times of
a rank's whole stage, all its chunks): megalite's step ends with a synchronous optimizer step (the global
gradient norm), so the next step cannot start under this one's tail, and the last rank's first forward
waits (pp-1) T_F / vp. ZB-H1 idles (pp-1)(T_F + T_B - T_W) / vp, 1F1B's (pp-1)(T_F + T_B + T_W) / vp less
two W per bubble; ZB-V the same at vp = 2 with 1F1B's memory. Both never below (pp-1) T_F / vp. The paper's
zero bubble for ZB-V (and ZB-H2) needs its optimizer post-validation, which lets steps overlap; megalite
does not do that.
"""

from __future__ import annotations

from megalite.parallel.pipeline.one_f_one_b import one_f_one_b
from megalite.parallel.pipeline.ops import B, F, Op, W
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import V


def zero_bubble_bubble(pp: int, vp: int, m: int, t_f: float, t_b: float, t_w: float,
                       t_fb: float | None = None) -> float:
    """(pp-1) max(T_F + T_B - T_W, T_F) / vp over m (T_F + T_B + T_W): the W operations fill what 1F1B's
    (T_F + T_B + T_W) leaves, but the last rank still waits for its first input."""
    return (pp - 1) * max(t_f + t_b - t_w, t_f) / (vp * m * (t_f + t_b + t_w))


def zb_h1(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """1F1B's order with split backwards, W deferred by rank 0's warm-up minus this rank's."""
    delay = _warmup(one_f_one_b(pp, vp, 0, m)) - _warmup(ops := one_f_one_b(pp, vp, rank, m))
    return _split(ops, delay)


def _warmup(ops: list[Op]) -> int:
    """Forwards before the first backward."""
    return next(index for index, op in enumerate(ops) if op.kind == B)


def _split(ops: list[Op], delay: int) -> list[Op]:
    """Each backward followed by the W of the backward `delay` backwards before it; the rest at the end."""
    result, waiting = [], []
    for op in ops:
        result.append(op)
        if op.kind == B:
            waiting.append(Op(W, op.chunk, op.microbatch))
            if len(waiting) > delay:
                result.append(waiting.pop(0))
    return result + waiting


def zb_v(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """ZB-V's phases on rank `rank` (chunk 0: model chunk rank, chunk 1: model chunk 2pp-1-rank)."""
    order = _VOrder(m)
    for _ in range(2 * (pp - rank) - 1):
        order.add(F, 0)
    for _ in range(rank):
        order.add(F, 1, 0)
    for _ in range(pp - rank):
        order.add(F, 1), order.add(B, 1), order.add(W, 1)
    while order.count[F][1] < m:
        for chunk in (0, 1):
            order.add(F, chunk), order.add(B, chunk), order.add(W, chunk)
    for _ in range(rank):
        order.add(B, 0, 1)
    for _ in range(pp - rank):
        order.add(B, 0), order.add(W, 0)
    order.finish()
    return order.ops


class _VOrder:
    """A rank's operations as the phases add them: each kind of each chunk in micro batch order, an operation
    only once its micro batch exists (fewer micro batches than the warm-up needs) and after its predecessor
    (B after F, W after B)."""

    def __init__(self, m: int) -> None:
        self.m, self.ops = m, []
        self.count = {kind: [0, 0] for kind in (F, B, W)}

    def add(self, kind: str, *chunks: int) -> None:
        before = {F: None, B: F, W: B}[kind]
        for chunk in chunks:
            done = self.count[kind][chunk]
            if done < self.m and (before is None or done < self.count[before][chunk]):
                self.ops.append(Op(kind, chunk, done))
                self.count[kind][chunk] += 1

    def finish(self) -> None:
        """What the phases left: weight gradients of chunk 1, then of chunk 0; any backward still missing."""
        for chunk in (1, 0):
            while self.count[W][chunk] < self.count[B][chunk]:
                self.add(W, chunk)
        for chunk in (0, 1):
            while self.count[B][chunk] < self.m:
                self.add(B, chunk), self.add(W, chunk)


ZB_H1 = ScheduleSpec("zb-h1", zb_h1, zero_bubble_bubble, split_backward=True, needs_pipeline=True,
                     doc="zero bubble, 1F1B's memory: backwards split into B and W, W in the bubbles (interleaved "
                         "when vp > 1)")
ZB_V = ScheduleSpec("zb-v", zb_v, zero_bubble_bubble, split_backward=True, chunk_order=V, needs_pipeline=True,
                    doc="zero bubble in a V: two chunks per rank (vp = 2), rank 0 holding the first and the last")
