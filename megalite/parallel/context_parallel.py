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
kernel that needs every head's K/V (the CPU's, see KERNELS_TAKING_GROUPS) gets them expanded. K and V travel as
one tensor (`_pack`): stacked when as wide (each block reaches the kernel contiguous), else side by side along the
width, so a v narrower than q and k (latent attention) travels unpadded and is padded only for the kernel.
The data pipeline slices tokens, labels, masks and position ids with `local_positions`.

With a sliding window (`window`) each (local chunk, source chunk) pair is a block of its own, trimmed to what the
window lets its queries see (attention_masks.py `visible`); pairs wholly outside the window are skipped, not
computed (their K/V still travel: at step j every rank needs some other rank's block). CUDA runs a trimmed block
through FlashAttention's own window arguments, the CPU kernel through a mask of that block. With attention sinks
(`sinks`, one logit per local head) the sink joins each query's merged softmax once, after every block, and its
gradient is handed to parallel/weight_grads.py (in W under a zero-bubble schedule) from each rank's own rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel.attention_masks import CAUSAL, FULL, Band, add_sinks, additive_mask, sink_gradient, visible
from megalite.parallel.mappings import gather_from_cp
from megalite.parallel.p2p import coalescing_device, post_batch
from megalite.parallel.weight_grads import deliver

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


@torch.no_grad()
def whole_sequence(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Every cp rank's `t` [batch, heads, 2c, d] (each in its local order) as the whole sequence, in position order:
    for measurements that need every key (QK-clip's largest logits, model/attention.py), whichever `comm` the
    attention itself uses; one all-gather of `t` over the cp group."""
    cp, local = dist.get_world_size(group), t.shape[2]
    gathered = gather_from_cp(t.contiguous(), group).unflatten(0, (cp, -1))  # [cp, batch, heads, 2c, d]
    order = torch.cat([local_positions(cp * local, cp, r, t.device) for r in range(cp)])
    return gathered.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, torch.argsort(order)]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                               comm: str = "p2p", window: int | None = None,
                               sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the local queries over the whole sequence of the cp group, softmax scale `scale` (default
    1/sqrt(d)), within `window` positions (None: all), with `sinks` (a logit per local head, a parameter: its
    gradient goes to weight_grads).

    q, k [batch, heads or groups, 2c, d]; v [batch, groups, 2c, dv] (query head h uses KV group
    h // (heads // groups)); all in the local token order of `local_positions`. Returns [batch, heads, 2c, dv]."""
    if comm not in COMMS:
        raise ValueError(f"context-parallel comm {comm!r} is not one of {COMMS}")
    if q.shape[2] % 2 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: need an even local length and heads "
                         "divisible by KV groups")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if comm == "allgather":
        cp = dist.get_world_size(group)
        gathered = gather_from_cp(_pack(k, v), group)  # rank-major along dim 0; backward reduce-scatters
        return _GatheredAttention.apply(q, gathered.unflatten(0, (cp, -1)), group, window, sinks, scale)
    return _RingAttention.apply(q, k, v, group, window, sinks, scale)


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
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size  # ranks in the group

    def source(self, step: int) -> int:
        """The cp rank whose K/V block this rank holds at `step`."""
        return (self.rank - step) % self.size

    def shift(self, *tensors: torch.Tensor) -> _Pending:
        """One batch: send each tensor to the next rank, receive its like from the previous one. Every rank posts
        the same list in the same order, so NCCL matches them (also when next == prev)."""
        if not tensors:
            return _Pending([], [])
        received = [torch.empty_like(t) for t in tensors]
        messages = [(True, t, self.next) for t in tensors] + [(False, r, self.prev) for r in received]
        return _Pending(post_batch(self.group, coalescing_device(self.group, tensors[0].device), messages), received)


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


Piece = tuple[slice, slice, Band]  # local query rows, the source's K/V rows, which of them each query sees


def _pieces(ring: _Ring, step: int, c: int, window: int | None) -> list[Piece]:
    """What this rank computes against the K/V block it holds at `step`: _block's rule without a window; with one,
    each pair of a local chunk and a source chunk trimmed to the window (none where it sees nothing)."""
    source = ring.source(step)
    if window is None:
        rows, cols, causal = _block(ring.rank, source, c)
        return [(rows, cols, CAUSAL if causal else FULL)]
    pieces = []
    for q_half, q_chunk in enumerate((ring.rank, 2 * ring.size - 1 - ring.rank)):
        for k_half, k_chunk in enumerate((source, 2 * ring.size - 1 - source)):
            seen = visible(q_chunk * c, c, k_chunk * c, c, window)
            if seen is not None:
                rows, cols, band = seen
                pieces.append((_shifted(rows, q_half * c), _shifted(cols, k_half * c), band))
    return pieces


def _shifted(rows: slice, by: int) -> slice:
    return slice(rows.start + by, rows.stop + by)


# Devices whose block kernel takes K/V per query group (fewer K/V heads than query heads): CUDA's flash kernel
# (FlashAttention-2) reads each group's K/V for all of its heads and sums their dK/dV itself, as SDPA's
# enable_gqa relies on. The CPU kernel gained groups only in recent torch releases (pytorch#157893; 2.13's has
# them), so there K/V are expanded to every head: a copy of each block per step, dK/dV summed back by _fold.
KERNELS_TAKING_GROUPS = {"cuda"}


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V [b, groups, 2c, d or dv] as the one tensor that travels: [2, b, groups, 2c, d] when as wide,
    else [b, groups, 2c, d + dv]."""
    return torch.stack([k, v]) if k.shape[-1] == v.shape[-1] else torch.cat([k, v], -1)


def _unpack(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_pack`'s K and V (views), given k's width `d`."""
    return (kv[0], kv[1]) if kv.dim() == 5 else (kv[..., :d], kv[..., d:])


def _for_kernel(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V as the block kernel on kv's device takes them: per group, or expanded to every query head."""
    groups = kv.shape[1]
    if groups == heads or kv.device.type in KERNELS_TAKING_GROUPS:
        return kv
    return kv.repeat_interleave(heads // groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum a per-head K/V gradient over the heads of each group (a no-op on one per group)."""
    return grad if grad.shape[1] == groups else grad.unflatten(1, (groups, -1)).sum(2)


def _plain_causal(band: Band, rows: int, cols: int) -> bool | None:
    """The is_causal flag of kernels without window arguments for `band` (None: the band needs the window)."""
    if band == FULL:
        return False
    return True if band == CAUSAL and rows == cols else None


def _one_width(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero-padded to the widest, as flash kernels take q, k, v: no score changes, extra output columns are 0."""
    width = max(t.shape[-1] for t in tensors)
    return tuple(F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in tensors)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band | bool,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One block through the fused kernel: output, log-sum-exp [b, heads, rows] (fp32), and what the
    CUDA backward wants back. `band`: which keys each query sees (True: causal, False: all). CUDA's flash kernel
    takes fp16/bf16 only; a band other than causal or full goes through its window arguments. A v narrower or
    wider than q and k runs padded (`_one_width`)."""
    width, scale = v.shape[-1], q.shape[-1] ** -0.5 if scale is None else scale
    if width != q.shape[-1]:
        out, lse, meta = _flash_forward(*_one_width(q, k, v), band, scale)
        return out[..., :width], lse, meta
    band = band if isinstance(band, Band) else CAUSAL if band else FULL
    causal = _plain_causal(band, q.shape[2], k.shape[2])
    k, v = _for_kernel(k, q.shape[1]), _for_kernel(v, q.shape[1])
    if q.is_cuda:
        if q.dtype == torch.float32:
            raise ValueError("context-parallel attention runs CUDA's flash attention kernel, which takes bf16 or "
                             "fp16 only: train with --train.precision=bf16 (or fp16)")
        if causal is None:
            left, right = _window_sizes(band)
            out, lse, rng, unused, _ = aten._flash_attention_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.shape[2], k.shape[2], 0.0,
                False, False, scale=scale, window_size_left=left, window_size_right=right)
            return out.transpose(1, 2), lse, (rng, unused)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    mask = None if causal is not None else additive_mask(band, q.shape[2], k.shape[2], q.dtype, q.device)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, bool(causal), attn_mask=mask,
                                                               scale=scale)
    return out, lse, ()


def _window_sizes(band: Band) -> tuple[int, int]:
    """FlashAttention's window_size_left / right of a band (-1: unbounded)."""
    return -1 if band.left is None else band.left, -1 if band.right is None else band.right


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, band: Band | bool, meta: tuple,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's dq, dk, dv (dk, dv per KV group). Given the final merged out and lse, the kernel's
    softmax is the one over the whole sequence (the sinks' column included), so the block's gradients are exact."""
    qk, width, scale = q.shape[-1], v.shape[-1], q.shape[-1] ** -0.5 if scale is None else scale
    if width != qk:
        q, k, v, out, dout = _one_width(q, k, v, out, dout)
        dq, dk, dv = _flash_backward(dout, q, k, v, out, lse, band, meta, scale)
        return dq[..., :qk], dk[..., :qk], dv[..., :width]
    band = band if isinstance(band, Band) else CAUSAL if band else FULL
    causal = _plain_causal(band, q.shape[2], k.shape[2])
    groups, lse = k.shape[1], lse.contiguous()
    k, v = _for_kernel(k, q.shape[1]), _for_kernel(v, q.shape[1])
    if q.is_cuda and causal is None:
        left, right = _window_sizes(band)
        dq, dk, dv = aten._flash_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse,
            None, None, q.shape[2], k.shape[2], 0.0, False, *meta, scale=scale, window_size_left=left,
            window_size_right=right)
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    elif q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = meta
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    else:
        mask = None if causal is not None else additive_mask(band, q.shape[2], k.shape[2], q.dtype, q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, bool(causal), attn_mask=mask, scale=scale)
    return dq, _fold(dk, groups), _fold(dv, groups)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's softmax-normalised output into the running fp32 one, in place, by log-sum-exp."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
                       + block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse[:, :, rows] = new


def _zeros_laid_out_as(q: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 zeros [b, heads, rows, width] whose dimensions lie in memory in q's order (as zeros_like keeps it): the
    output then goes back to the layout q came from as a view, where a contiguous one would cost a saved copy."""
    order = sorted(range(q.dim()), key=q.stride, reverse=True)
    shape = [*q.shape[:-1], width]
    return q.new_zeros([shape[i] for i in order], dtype=torch.float32).permute([order.index(i) for i in range(q.dim())])


def _attend(q: torch.Tensor, ring: _Ring, blocks: Iterator[torch.Tensor], window: int | None,
            sinks: torch.Tensor | None, scale: float, width: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Forward over the K/V blocks of every cp rank, in ring order (step j: cp rank i-j's, as `_pack` packs them),
    merged by log-sum-exp, then the sinks: the output (v's `width`) in q's dtype, the fp32 log-sum-exp, and each step's
    pieces' kernel extras."""
    c, d, metas = q.shape[2] // 2, q.shape[-1], []
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    out = _zeros_laid_out_as(q, width)
    for step, kv in enumerate(blocks):
        k, v = _unpack(kv, d)
        metas.append([])
        for rows, cols, band in _pieces(ring, step, c, window):
            block_out, block_lse, meta = _flash_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], band, scale)
            metas[-1].append(meta)
            _merge(out, lse, rows, block_out, block_lse)
    if sinks is not None:
        lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse, metas


def _block_grads(ctx, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dout: torch.Tensor, dq: torch.Tensor,
                 step: int, kv: torch.Tensor) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Step `step`'s block backward: adds into dq, returns each piece's columns and its dK, dV (per KV group).
    `saved`: q, out, lse (read from ctx.saved_tensors once: a recompute lets them be unpacked only once)."""
    q, out, lse = saved
    grads, (k, v) = [], _unpack(kv, q.shape[-1])
    for (rows, cols, band), meta in zip(_pieces(ctx.ring, step, q.shape[2] // 2, ctx.window), ctx.metas[step]):
        block_dq, dk, dv = _flash_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                           out[:, :, rows], lse[:, :, rows], band, meta, ctx.scale)
        dq[:, :, rows] += block_dq
        grads.append((cols, dk, dv))
    return grads


def _keep(ctx, ring: _Ring, window: int | None, sinks: torch.Tensor | None, metas: list, scale: float) -> None:
    """What backward reads besides the saved tensors; the sinks (a parameter) on ctx, not saved: a checkpoint's
    recompute would save a copy, not the parameter its gradient belongs to."""
    ctx.ring, ctx.window, ctx.sinks, ctx.metas, ctx.scale = ring, window, sinks, metas, scale


def _sinks_backward(ctx, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The sinks' gradient from this rank's rows, handed to weight_grads (in W under a zero-bubble schedule)."""
    if ctx.sinks is not None:
        grad = sink_gradient(dout, out, lse, ctx.sinks)
        deliver(ctx.sinks, lambda: grad)


class _RingAttention(torch.autograd.Function):
    """Ring attention; K/V (and dK/dV) travel as one tensor (`_pack`)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, window: int | None,
                sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        ring = _Ring(group)

        def blocks() -> Iterator[torch.Tensor]:
            kv = _pack(k, v)
            for step in range(ring.size):
                pending = ring.shift(kv) if step < ring.size - 1 else None
                yield kv  # attended while the shift is in flight
                if pending is not None:
                    kv = pending.wait()[0]

        out, lse, metas = _attend(q, ring, blocks(), window, sinks, scale, v.shape[-1])
        ctx.save_for_backward(q, k, v, out, lse)
        _keep(ctx, ring, window, sinks, metas, scale)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None,
                                                   None]:
        """Step j attends the same block as forward step j. The block's dK/dV accumulator arrives from the
        rank that used it one step earlier, while this rank computes its own part, and leaves with the
        next step's batch; after the last step one hop returns each accumulator to its owner."""
        q, k, v, out, lse = ctx.saved_tensors
        dout, ring, d = dout.contiguous(), ctx.ring, q.shape[-1]
        kv, grads = _pack(k, v), None
        dq = torch.zeros_like(q, dtype=torch.float32)
        for step in range(ring.size):
            last = step == ring.size - 1
            pending = ring.shift(*([] if last else [kv]), *([] if grads is None else [grads]))
            pieces = _block_grads(ctx, (q, out, lse), dout, dq, step, kv)
            incoming = pending.wait()
            next_kv = None if last else incoming.pop(0)
            grads = incoming.pop(0) if grads is not None else torch.zeros_like(kv, dtype=torch.float32)
            grad_k, grad_v = _unpack(grads, d)
            for cols, dk, dv in pieces:
                grad_k[:, :, cols] += dk
                grad_v[:, :, cols] += dv
            kv = next_kv
        if ring.size > 1:
            grads = ring.shift(grads).wait()[0]
        _sinks_backward(ctx, dout, out, lse)
        grad_k, grad_v = _unpack(grads, d)
        return dq.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


class _GatheredAttention(torch.autograd.Function):
    """The same blocks as the ring, over K/V already gathered from every cp rank ([cp, ...] of `_pack`'s):
    no whole-sequence mask is materialised and the fused kernels run as in the ring; backward returns every rank's
    dK/dV, which the all-gather's backward reduce-scatters to their owners."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, gathered: torch.Tensor, group: Group, window: int | None,
                sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        ring = _Ring(group)
        blocks = (gathered[ring.source(step)] for step in range(ring.size))
        width = _unpack(gathered[0], q.shape[-1])[1].shape[-1]
        out, lse, metas = _attend(q, ring, blocks, window, sinks, scale, width)
        ctx.save_for_backward(q, gathered, out, lse)
        _keep(ctx, ring, window, sinks, metas, scale)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:
        q, gathered, out, lse = ctx.saved_tensors
        dout, ring, d = dout.contiguous(), ctx.ring, q.shape[-1]
        dq = torch.zeros_like(q, dtype=torch.float32)
        grads = torch.zeros_like(gathered, dtype=torch.float32)
        for step in range(ring.size):
            source = ring.source(step)
            grad_k, grad_v = _unpack(grads[source], d)
            for cols, dk, dv in _block_grads(ctx, (q, out, lse), dout, dq, step, gathered[source]):
                grad_k[:, :, cols] += dk
                grad_v[:, :, cols] += dv
        _sinks_backward(ctx, dout, out, lse)
        return dq.to(q.dtype), grads.to(gathered.dtype), None, None, None, None
