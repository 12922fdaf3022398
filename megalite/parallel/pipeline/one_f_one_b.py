"""Megatron-LM's pipeline orders: GPipe, 1F1B (gradient accumulation at pp = 1), interleaved 1F1B with virtual
chunks (its warm-up count and micro batch ordering), and evaluation's forwards; each with its spec."""

from __future__ import annotations

from megalite.parallel.pipeline.ops import B, F, Op, OpKind
from megalite.parallel.pipeline.spec import ScheduleSpec, forwards


def one_f_one_b_bubble(pp: int, vp: int, m: int, t_f: float, t_b: float, t_w: float,
                       t_fb: float | None = None) -> float:
    """Megatron-LM's (pp - 1) / (vp * m): each of the first pp - 1 micro batches' forward and whole backward
    (B and W together) idles some rank; interleaving cuts each chunk's share by vp."""
    return (pp - 1) / (vp * m)


def gpipe(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Every forward, then every backward: simple, but all m micro batches' activations are held."""
    return [Op(F, 0, i) for i in range(m)] + [Op(B, 0, i) for i in range(m)]


def one_f_one_b(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """1F1B: after a warm-up of forwards, alternate one forward and one backward, so a rank holds at
    most pp - rank micro batches' activations; interleaved over the rank's chunks when vp > 1."""
    if pp == 1 or vp == 1:  # pp = 1: the whole model is one chunk
        warmup = min(pp - rank - 1, m)
        steady = [op for i in range(m - warmup) for op in (Op(F, 0, warmup + i), Op(B, 0, i))]
        return [Op(F, 0, i) for i in range(warmup)] + steady + [Op(B, 0, i) for i in range(m - warmup, m)]
    return _interleaved(pp, vp, rank, m)


def _interleaved(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B: micro batches go through the chunks in groups of pp, with its
    warm-up count (every forward first when m == pp)."""
    total = m * vp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vp - 1) * pp, total)

    def virtual(k: int, kind: OpKind) -> Op:
        chunk = (k % (pp * vp)) // pp
        return Op(kind, chunk if kind == F else vp - 1 - chunk, (k // (pp * vp)) * pp + k % pp)

    steady = [op for i in range(total - warmup) for op in (virtual(warmup + i, F), virtual(i, B))]
    return [virtual(k, F) for k in range(warmup)] + steady + [virtual(k, B) for k in range(total - warmup, total)]


FORWARD = ScheduleSpec("forward", forwards, bubble=None, doc="forwards only (evaluation); not a training schedule")
GPIPE = ScheduleSpec("gpipe", gpipe, one_f_one_b_bubble, vp=1,
                     doc="all forwards, then all backwards: every micro batch's activations held at once")
ONE_F_ONE_B = ScheduleSpec("1f1b", one_f_one_b, one_f_one_b_bubble,
                           doc="one forward, one backward after a warm-up (interleaved when vp > 1)")
