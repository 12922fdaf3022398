"""Context parallelism: every cp rank holds a slice of each sample's sequence, attention sees all of it.

The sequence of length S is cut into 2*cp chunks of c = S / (2*cp) tokens; cp rank i holds chunk i
and chunk 2*cp-1-i, concatenated in that order (local length 2c). For cp=2:

    global sequence   | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
    rank 0 (local)    | chunk 0 | chunk 3 |
    rank 1 (local)    | chunk 1 | chunk 2 |

Why two chunks: under a causal mask a query attends all earlier tokens, so the work of a chunk grows
with its position. Pairing an early chunk with its mirror-image late one gives every rank the same
number of (query, key) pairs, where contiguous slices would leave rank 0 idle while the last rank works.

Everything outside attention is token-local, so q, k, v are computed from the local tokens; only
attention needs the other ranks' keys and values. Two ways to bring them (`comm`):

- "p2p", ring attention: cp steps; at step j the rank attends the K/V block of cp rank i-j while
  that block moves on to rank i+1 in one batched send/receive, so the cp-1 hops overlap the blocks'
  compute. Partial outputs merge by their log-sum-exp; memory holds two K/V blocks, not the whole
  sequence. Backward sends the K/V around again with the dK/dV accumulators trailing one hop behind,
  and one last hop brings every accumulator home.
- "allgather" (Llama 3's choice): one all-gather of K/V (backward: one reduce-scatter of dK/dV),
  then the same blocks as the ring, read from the gathered K/V (no mask is ever materialised: a
  boolean prefix mask would cost (2cp+1) c^2 elements per layer, kept for backward). Every rank
  holds the whole sequence's K/V for the layer (kept for backward unless recomputed), and the
  collective does not overlap compute, but at small cp one collective is cheaper than cp-1
  latency-bound hops.

K/V travel as their query groups (grouped-query attention) and reach CUDA's flash kernel so; only a
kernel that needs every head's K/V (the CPU's, see KERNELS_TAKING_GROUPS) gets them expanded.
The data pipeline slices tokens, labels, masks and position ids with `local_positions`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel.mappings import gather_from_cp

Group = dist.ProcessGroup
aten = torch.ops.aten
COMMS = ("p2p", "allgather")


def local_positions(seq_length: int, cp: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of cp rank `cp_rank`'s tokens in local order: chunk cp_rank, then chunk 2*cp-1-cp_rank."""
    if seq_length % (2 * cp):
        raise ValueError(f"model.seq_length={seq_length} must be divisible by 2 * parallel.cp = {2 * cp} "
                         "(each cp rank holds two equal chunks)")
    c = seq_length // (2 * cp)
    offsets = torch.arange(c, device=device)
    return torch.cat([cp_rank * c + offsets, (2 * cp - 1 - cp_rank) * c + offsets])


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                               comm: str = "p2p") -> torch.Tensor:
    """Causal attention of the local queries over the whole sequence of the cp group, scale 1/sqrt(d).

    q [batch, heads, 2c, d]; k, v [batch, groups, 2c, d] (query head h uses KV group h // (heads // groups));
    all in the local token order of `local_positions`. Returns [batch, heads, 2c, d]."""
    if comm not in COMMS:
        raise ValueError(f"context-parallel comm {comm!r} is not one of {COMMS}")
    if q.shape[2] % 2 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: need an even local length and heads "
                         "divisible by KV groups")
    if comm == "allgather":
        cp = dist.get_world_size(group)
        gathered = gather_from_cp(torch.stack([k, v]), group)  # [cp * 2, ...] rank-major; backward reduce-scatters
        return _GatheredAttention.apply(q, gathered.unflatten(0, (cp, 2)), group)
    return _RingAttention.apply(q, k, v, group)


# ----------------------------------------------------------------------------------------------- ring


@dataclass
class _Pending:
    """One posted batch of the ring: wait() before reading what it receives."""

    works: list[dist.Work]
    received: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


class _Ring:
    """This rank's place in the cp ring: K/V move from rank i to rank i+1."""

    def __init__(self, group: Group) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """The cp rank whose K/V block this rank holds at `step`."""
        return (self.rank - step) % self.size

    def shift(self, *tensors: torch.Tensor) -> _Pending:
        """One batch_isend_irecv: send each tensor to the next rank, receive its like from the previous one.
        Every rank posts the same list in the same order, so NCCL matches them (also when next == prev)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], received)


def _block(rank: int, source: int, c: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend which rows of cp rank `source`'s K/V, and whether causally.

    Own block: causal over the local 2c tokens (chunk rank precedes chunk 2cp-1-rank). An earlier rank's
    block: its first chunk precedes both local chunks, its second follows both. A later rank's block:
    only the local second chunk (the last of the three) follows both of its chunks."""
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


# Devices whose block kernel takes K/V per query group (fewer K/V heads than query heads): CUDA's flash kernel
# (FlashAttention-2) reads each group's K/V for all of its heads and sums their dK/dV itself, as SDPA's
# enable_gqa relies on. The CPU kernel gained groups only in recent torch releases (pytorch#157893; 2.13's has
# them), so there K/V are expanded to every head: a copy of each block per step, dK/dV summed back by _fold.
KERNELS_TAKING_GROUPS = {"cuda"}


def _for_kernel(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V as the block kernel on kv's device takes them: per group, or expanded to every query head."""
    groups = kv.shape[1]
    if groups == heads or kv.device.type in KERNELS_TAKING_GROUPS:
        return kv
    return kv.repeat_interleave(heads // groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum a per-head K/V gradient over the heads of each group (a no-op on one per group)."""
    return grad if grad.shape[1] == groups else grad.unflatten(1, (groups, -1)).sum(2)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One block through the fused kernel: output, log-sum-exp [b, heads, rows] (fp32), and what the
    CUDA backward wants back. CUDA's flash kernel takes fp16/bf16 only."""
    k, v, scale = _for_kernel(k, q.shape[1]), _for_kernel(v, q.shape[1]), q.shape[-1] ** -0.5
    if q.is_cuda:
        if q.dtype == torch.float32:
            raise ValueError("context-parallel attention runs CUDA's flash attention kernel, which takes bf16 or "
                             "fp16 only: train with --train.precision=bf16 (or fp16)")
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, meta: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's dq, dk, dv (dk, dv per KV group). Given the final merged out and lse, the kernel's
    softmax is the one over the whole sequence, so the block's gradients are exact."""
    groups, lse = k.shape[1], lse.contiguous()
    k, v, scale = _for_kernel(k, q.shape[1]), _for_kernel(v, q.shape[1]), q.shape[-1] ** -0.5
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = meta
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, _fold(dk, groups), _fold(dv, groups)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's softmax-normalised output into the running fp32 one, in place, by log-sum-exp."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
                       + block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse[:, :, rows] = new


def _attend(q: torch.Tensor, ring: _Ring, blocks: Iterator[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Forward over the K/V blocks of every cp rank, in ring order (step j: cp rank i-j's [2, b, g, 2c, d]),
    merged by log-sum-exp: the output in q's dtype, the fp32 log-sum-exp, and each block's kernel extras."""
    c, out, lse, metas = q.shape[2] // 2, None, None, []
    for step, kv in enumerate(blocks):
        rows, cols, causal = _block(ring.rank, ring.source(step), c)
        block_out, block_lse, meta = _flash_forward(q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], causal)
        metas.append(meta)
        if out is None:
            out, lse = block_out.float(), block_lse.float().contiguous()
        else:
            _merge(out, lse, rows, block_out, block_lse)
    return out.to(q.dtype), lse, metas


def _block_grads(ctx, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dout: torch.Tensor, dq: torch.Tensor,
                 step: int, kv: torch.Tensor) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """Step `step`'s block backward: adds into dq, returns the block's columns and its dK, dV (per KV group).
    `saved`: q, out, lse (read from ctx.saved_tensors once: a recompute lets them be unpacked only once)."""
    q, out, lse = saved
    ring, c = ctx.ring, q.shape[2] // 2
    rows, cols, causal = _block(ring.rank, ring.source(step), c)
    block_dq, dk, dv = _flash_backward(dout[:, :, rows], q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols],
                                       out[:, :, rows], lse[:, :, rows], causal, ctx.metas[step])
    dq[:, :, rows] += block_dq
    return cols, dk, dv


class _RingAttention(torch.autograd.Function):
    """Ring attention; K/V (and dK/dV) travel as one [2, b, groups, 2c, d] tensor."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
        ring = _Ring(group)

        def blocks() -> Iterator[torch.Tensor]:
            kv = torch.stack([k, v])
            for step in range(ring.size):
                pending = ring.shift(kv) if step < ring.size - 1 else None
                yield kv  # attended while the shift is in flight
                if pending is not None:
                    kv = pending.wait()[0]

        out, lse, ctx.metas = _attend(q, ring, blocks())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """Step j attends the same block as forward step j. The block's dK/dV accumulator arrives from the
        rank that used it one step earlier, while this rank computes its own part, and leaves with the
        next step's batch; after the last step one hop returns each accumulator to its owner."""
        q, k, v, out, lse = ctx.saved_tensors
        dout, ring = dout.contiguous(), ctx.ring
        kv, grads = torch.stack([k, v]), None
        dq = torch.zeros_like(q, dtype=torch.float32)
        for step in range(ring.size):
            last = step == ring.size - 1
            pending = ring.shift(*([] if last else [kv]), *([] if grads is None else [grads]))
            cols, dk, dv = _block_grads(ctx, (q, out, lse), dout, dq, step, kv)
            incoming = pending.wait()
            next_kv = None if last else incoming.pop(0)
            grads = incoming.pop(0) if grads is not None else torch.zeros_like(kv, dtype=torch.float32)
            grads[0, :, :, cols] += dk
            grads[1, :, :, cols] += dv
            kv = next_kv
        if ring.size > 1:
            grads = ring.shift(grads).wait()[0]
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


class _GatheredAttention(torch.autograd.Function):
    """The same blocks as the ring, over K/V already gathered from every cp rank ([cp, 2, b, g, 2c, d]):
    no masks are materialised and the fused kernels run as in the ring; backward returns every rank's dK/dV,
    which the all-gather's backward reduce-scatters to their owners."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, gathered: torch.Tensor, group: Group) -> torch.Tensor:
        ring = _Ring(group)
        out, lse, ctx.metas = _attend(q, ring, (gathered[ring.source(step)] for step in range(ring.size)))
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        q, gathered, out, lse = ctx.saved_tensors
        dout, ring = dout.contiguous(), ctx.ring
        dq = torch.zeros_like(q, dtype=torch.float32)
        grads = torch.zeros_like(gathered, dtype=torch.float32)
        for step in range(ring.size):
            source = ring.source(step)
            cols, dk, dv = _block_grads(ctx, (q, out, lse), dout, dq, step, gathered[source])
            grads[source, 0, :, :, cols] += dk
            grads[source, 1, :, :, cols] += dv
        return dq.to(q.dtype), grads.to(gathered.dtype), None
