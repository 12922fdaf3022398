"""DualPipeV: DeepSeek's DualPipe cut in half (DeepSeek-V3 report, arXiv 2412.19437; deepseek-ai/DualPipe).

Each of the pp ranks holds two chunks in a V (stage.py's V order, as ZB-V): rank r chunk 0 is model chunk r,
chunk 1 model chunk 2pp-1-r, so rank 0 holds the first and the last. Its steady phase pairs the forward of one
chunk with the whole backward of the other (`Paired`, F&B): on an accelerator one micro batch's expert
all-to-all (dispatch and combine) travels while the other micro batch computes (overlap.py), which is what
makes DualPipe worth its memory for mixture-of-experts models. The phases of rank r (m >= 2 pp micro batches):

1. 2(pp-r-1) forwards of chunk 0;
2. r+1 times: a forward of chunk 0, then one of chunk 1;
3. pp-r-1 times: B of chunk 1, its W, a forward of chunk 1;
4. m-2pp+r+1 times: F0 & B1, then F1 & B0 (the last rank runs its first F0 and B1 apart: the B1 needs the
   F1 that its F0 feeds);
5. pp-r-1 times: B of chunk 1, then F1 & B0;
6. r+1 times: B of chunk 1, B of chunk 0: whole backwards in the first half, split ones (W later) after;
7. pp-r-1 times: a queued W, B of chunk 0 (split);
8. the r+1 W left.

Every backward outside phases 3, 6 and 7 is whole (B with W, no W operation); the others leave their W to the
queue, oldest first.

The bubble in megalite's terms. DeepSeek's table gives DualPipe (PP/2 - 1)(F&B + B - 3W), PP its stages and F,
B, W, F&B chunk times, B the whole backward (megalite's B + W). DualPipeV holds 2 pp chunks on pp ranks: its
PP/2 - 1 is pp - 1, and (pp-1)(F&B + B - 3W) per chunk idles. In a rank's stage times (T: both chunks; T_FB a
paired forward and whole backward of both, T_F + T_B + T_W where a pair hides nothing, as on sleeping CPU ranks)
the idle share of the ideal step m (T_F + T_B + T_W) is

    (pp-1) (T_FB + T_B - 2 T_W) / (2 m (T_F + T_B + T_W)).

Played out (planning/bubble.py; tests/test_dualpipe.py) the op lists idle exactly that where T_B = T_F >= T_W,
and at most that where T_F <= T_B and T_W <= T_F (0.67-0.98 of it), transformer layers' usual ratios; a
forward longer than B, or a W longer than F, idles more than the formula, as the ramps then wait on forwards.
ZB-V, (pp-1)(T_F + T_B - T_W) / (2 m T), idles half as much at equal times: DualPipeV earns the difference
back only where hiding the all-to-all in its F&B saves more (the README's schedule guide).
"""

from __future__ import annotations

from megalite.parallel.pipeline.ops import B, F, Op, OpKind, Paired, ScheduleOp, W
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import V


def dualpipe_v_bubble(pp: int, vp: int, m: int, t_f: float, t_b: float, t_w: float,
                      t_fb: float | None = None) -> float:
    """(pp-1)(F&B + B - 3W) per chunk (B: the whole backward, T_B + T_W) over m (T_F + T_B + T_W); F&B = F + B
    where nothing is hidden."""
    fb = t_f + t_b + t_w if t_fb is None else t_fb
    return (pp - 1) * (fb + t_b - 2 * t_w) / (2 * m * (t_f + t_b + t_w))


def dualpipe_v(pp: int, vp: int, rank: int, m: int) -> list[ScheduleOp]:
    """DualPipeV's phases on rank `rank` (module docstring)."""
    order, r = _Order(), rank
    for _ in range(2 * (pp - r - 1)):
        order.add(F, 0)
    for _ in range(r + 1):
        order.add(F, 0), order.add(F, 1)
    for _ in range(pp - r - 1):
        order.add(B, 1, split=True), order.weight(), order.add(F, 1)
    for i in range(m - 2 * pp + r + 1):
        if i == 0 and r == pp - 1:
            order.add(F, 0), order.add(B, 1)
        else:
            order.pair(0)
        order.pair(1)
    for _ in range(pp - r - 1):
        order.add(B, 1), order.pair(1)
    split = False
    for i in range(r + 1):  # whole backwards until half way, split ones after (the odd ranks switch a B earlier)
        split |= i == (r + 1) // 2 and r % 2 == 1
        order.add(B, 1, split=split)
        split |= i == (r + 1) // 2 and r % 2 == 0
        order.add(B, 0, split=split)
    for _ in range(pp - r - 1):
        order.weight(), order.add(B, 0, split=True)
    while order.queued:
        order.weight()
    return order.ops


class _Order:
    """A rank's operations as the phases add them: each kind of each chunk in micro batch order, split
    backwards' W queued oldest first."""

    def __init__(self) -> None:
        self.ops: list[ScheduleOp] = []
        self.next = {(kind, chunk): 0 for kind in (F, B) for chunk in (0, 1)}
        self.queued: list[Op] = []

    def take(self, kind: OpKind, chunk: int) -> Op:
        op = Op(kind, chunk, self.next[(kind, chunk)])
        self.next[(kind, chunk)] += 1
        return op

    def add(self, kind: OpKind, chunk: int, split: bool = False) -> None:
        op = self.take(kind, chunk)
        self.ops.append(op)
        if split:
            self.queued.append(Op(W, chunk, op.microbatch))

    def pair(self, forward_chunk: int) -> None:
        """F of `forward_chunk` with the whole backward of the other."""
        self.ops.append(Paired(self.take(F, forward_chunk), self.take(B, 1 - forward_chunk)))

    def weight(self) -> None:
        if self.queued:
            self.ops.append(self.queued.pop(0))


DUALPIPE_V = ScheduleSpec(
    "dualpipev", dualpipe_v, dualpipe_v_bubble, split_backward=True, chunk_order=V, needs_pipeline=True,
    min_microbatches_per_rank=2,
    doc="DeepSeek's DualPipeV: ZB-V's V, steady phase pairs one micro batch's forward with another's backward so "
        "that expert all-to-alls hide behind compute (needs 2 pp micro batches)")
