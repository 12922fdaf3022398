"""Causal attention with a sliding window and/or attention sinks on one device, in training and in generation.

What kernel runs, and why: SDPA has no sink and takes a window only as a full [queries, keys] mask (16 GiB of it a
layer at 128k tokens); FlashAttention has sliding windows (window_size_left / right) but no sink; flex_attention
is fused only under torch.compile. No sink kernel is needed: a sink changes only the softmax's normaliser, so the
block kernels of context parallelism (parallel/context_parallel.py) run the windowed attention, the sink is folded
into their output and log-sum-exp once (attention_masks.py `add_sinks`), and their backward, given that output and
log-sum-exp, yields exact dq, dk, dv; the sink's gradient is a sum over the queries. On CUDA in bf16/fp16 that is
FlashAttention-2's windowed kernel, which computes only the tiles inside the window and keeps no score matrix; on
the CPU the fused CPU kernel with the block's mask. CUDA's flash kernel takes no fp32: there (generation in fp32,
say) the block's scores are computed in full, by `_math_forward`.

The queries are the last of the keys' positions (the new tokens of a generation step after the cached ones), so
one block covers the whole attention: the keys before any query's window are cut off first, never computed.
"""

from __future__ import annotations

import torch

from megalite.parallel.attention_masks import Band, add_sinks, additive_mask, sink_gradient, visible
from megalite.parallel.context_parallel import _flash_backward, _flash_forward, _fold
from megalite.parallel.weight_grads import deliver


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                       sinks: torch.Tensor | None) -> torch.Tensor:
    """q [batch, heads, new, d]; k, v [batch, groups, past + new, d]: new token i sees the keys at past + i and the
    window - 1 before it (all earlier ones without a window), and its head's sink (a parameter [heads]: its
    gradient goes to weight_grads). Scale 1/sqrt(d). Returns [batch, heads, new, d]."""
    return _WindowedAttention.apply(q, k, v, window, sinks)


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  band: Band) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The block kernel's contract (output, fp32 log-sum-exp) computed from the block's full score matrix."""
    scores = _scores(q, k, band)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ _every_head(v, q.shape[1])
    return out.to(q.dtype), lse, ()


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, band: Band, meta: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (per KV group) given the final output and log-sum-exp, as the kernels' backward computes them."""
    groups, scale, dout = k.shape[1], q.shape[-1] ** -0.5, dout.float()
    probs = torch.exp(_scores(q, k, band) - lse.unsqueeze(-1))
    dprobs = dout @ _every_head(v, q.shape[1]).transpose(-1, -2)
    dscores = probs * (dprobs - (dout * out.float()).sum(-1, keepdim=True)) * scale
    dq = dscores @ _every_head(k, q.shape[1])
    dk, dv = dscores.transpose(-1, -2) @ q.float(), probs.transpose(-1, -2) @ dout
    return dq.to(q.dtype), _fold(dk, groups).to(k.dtype), _fold(dv, groups).to(v.dtype)


def _every_head(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V in fp32, one per query head (the matmuls here take no groups)."""
    return kv.float().repeat_interleave(heads // kv.shape[1], dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, band: Band) -> torch.Tensor:
    scores = q.float() @ _every_head(k, q.shape[1]).transpose(-1, -2) * q.shape[-1] ** -0.5
    mask = additive_mask(band, q.shape[2], k.shape[2], torch.float32, q.device)
    return scores if mask is None else scores + mask


def _kernels(q: torch.Tensor) -> tuple:
    """The block kernel's forward and backward for q's device and dtype."""
    if q.is_cuda and q.dtype == torch.float32:
        return _math_forward, _math_backward
    return _flash_forward, _flash_backward


class _WindowedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
        _, cols, band = visible(k.shape[2] - q.shape[2], q.shape[2], 0, k.shape[2], window)
        out, lse, meta = _kernels(q)[0](q, k[:, :, cols], v[:, :, cols], band)
        if sinks is not None:
            out = out.float()
            lse = add_sinks(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cols, ctx.band, ctx.meta = cols, band, meta
        ctx.sinks = sinks  # on ctx, not saved: a checkpoint's recompute would save a copy, not the parameter
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        dout, cols = dout.contiguous(), ctx.cols
        dq, dk_seen, dv_seen = _kernels(q)[1](dout, q, k[:, :, cols], v[:, :, cols], out, lse, ctx.band, ctx.meta)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :, cols], dv[:, :, cols] = dk_seen, dv_seen
        if ctx.sinks is not None:
            grad = sink_gradient(dout, out, lse, ctx.sinks)
            deliver(ctx.sinks, lambda: grad)
        return dq, dk, dv, None, None
