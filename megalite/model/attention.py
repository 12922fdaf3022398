"""Causal self-attention with a fused QKV projection and grouped-query attention.

The QKV weight is laid out group by group, each group holding its query heads then its
one key and one value head ([g0: q.. k v][g1: q.. k v]...). Splitting that matrix into
contiguous row blocks hands every tensor-parallel rank whole groups, which is why the
layout differs from Hugging Face's [all q][all k][all v] (the HF mapping reorders).

During generation a KV cache (model/kv_cache.py) supplies the keys and values of earlier
tokens; the new tokens' queries then attend to those plus their own causal prefix.

With `qkv_bias` (Qwen2) the QKV projection has a bias even where `bias` gives the others none. Each head is
model.head_dim wide, which need not be hidden / heads (Qwen3's released models).

With `qk_norm` (Qwen3) every query and key head is RMS-normalised over its head_dim before RoPE, by one
weight per projection shared by all heads. Each tensor-parallel rank applies it to its own heads, so its
gradient there is a partial sum over tp, as the weights' placement says.

Selective recompute (model/recompute.py sets `recompute_core`) keeps only the inputs of the
core attention and recomputes it in backward.

Under context parallelism (`cp`) a rank's q, k, v are those of its part of every sequence, and the
core attention sees the other parts' keys and values through parallel/context_parallel.py.

A layer with a sliding window (model.sliding_window in model.sliding_window_layers) attends to the window's keys
only, and with attention sinks (gpt-oss) each head has a learned logit `sinks` that joins its softmax as a column
with no value; both run through model/windowed_attention.py on one device (context_parallel.py under cp). The
sinks are split over tp with the heads; a generation cache keeps only a windowed layer's window.

Its costs (model/costs.py): attention is SDPA (flash), so no s^2 scores are kept, and selective recompute
keeps only q, k and v; q, k and v are views of the fused QKV output; per token it multiplies its two weights and
computes the s x s square of scores and weighted sums over the full square (as Megatron-LM and PaLM count it),
or with a sliding window the pairs the window keeps by the same measure (`attended_keys`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.costs import MicroBatch, kept_input_bytes, linear_held, row_bias_held, weights_multiplied
from megalite.model.kv_cache import LayerCache
from megalite.model.norms import build_norm, recomputed_held
from megalite.model.rope import apply_rope
from megalite.model.windowed_attention import windowed_attention
from megalite.parallel.context import AxisView, ParallelContext
from megalite.parallel.context_parallel import context_parallel_attention, local_positions, whole_sequence
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.placement import Fused, Placement
from megalite.parallel.random import checkpoint_with_rng


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
    """Each head's largest causal attention logit q.k * scale, the softmax's input (scale default 1/sqrt(d);
    q [batch, heads, s, d], k [batch, groups, t, d]), in fp32: an extra pass over QK^T, since the fused kernel
    returns no logits (its cost: one more QK^T matmul and an s x t block of scores per head). `positions`: the
    queries' positions among the keys (default: the last s), each seeing the keys up to its own."""
    q, k = q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    keys = torch.arange(k.shape[2], device=q.device)
    positions = keys[k.shape[2] - q.shape[2]:] if positions is None else positions.to(q.device)
    return scores.masked_fill(keys > positions[:, None], float("-inf")).amax(dim=(0, 2, 3))


def tracked_max_logits(q: torch.Tensor, k: torch.Tensor, cp: AxisView,
                       scale: float | None = None) -> torch.Tensor:
    """`max_logits` of this rank's queries against every key they attend to: under context parallelism the whole
    sequence's keys, gathered over cp (context_parallel.py whole_sequence), whether the attention rings or gathers.
    QK-clip's measurement (training/qk_clip.py), for standard and latent attention alike."""
    if cp.size == 1:
        return max_logits(q, k, scale=scale)
    keys = whole_sequence(k, cp.group)
    return max_logits(q, keys, local_positions(keys.shape[2], cp.size, cp.rank, q.device), scale)


class SelfAttention(nn.Module):
    """Each tensor-parallel rank computes whole query groups: heads/tp query and groups/tp KV heads."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, device: torch.device, index: int = 0) -> None:
        """`device`: where the model will live (which norm implementation runs); `index`: the layer's global
        index (whether it has the sliding window)."""
        super().__init__()
        tp = ctx.tp.size
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads // tp, cfg.kv_heads // tp, cfg.head_size
        bias = cfg.features.bias
        qkv_rows = (cfg.num_attention_heads + 2 * cfg.kv_heads) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(cfg.hidden_size, qkv_rows, ctx, bias or cfg.features.qkv_bias)
        self.linear_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, ctx, bias)
        qkv = Fused(cfg.kv_heads, (cfg.num_attention_heads // cfg.kv_heads, 1, 1), heads=True)  # q.. k v per group
        self.linear_qkv.placements["weight"] = dataclasses.replace(self.linear_qkv.placements["weight"], fused=qkv)
        self.q_norm = self.k_norm = None
        self.placements: dict[str, Placement] = {}
        if cfg.features.qk_norm:
            self.q_norm = build_norm("rmsnorm", self.head_dim, cfg.norm_epsilon, device)
            self.k_norm = build_norm("rmsnorm", self.head_dim, cfg.norm_epsilon, device)
            partial = Placement(partial=("tp",) if tp > 1 else ())  # every rank's heads add to the one weight
            self.placements |= {"q_norm.weight": partial, "k_norm.weight": partial}
        self.window = cfg.window(index)
        self.sinks = None
        if cfg.features.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.heads))
            self.placements["sinks"] = Placement.split("tp", 0)  # a logit per head: split with the heads
        self.dropout = cfg.attention_dropout
        self.recompute_core = False
        # MuonClip's QK-clip (training/qk_clip.py) sets a tensor here: each head's largest logit since it was reset
        self.max_logits: torch.Tensor | None = None
        self.fused = True  # train.fusions: RoPE as model/fused.py's one kernel each way
        self.ctx = ctx
        self.rope = cfg.features.position_embedding == "rope"

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x: [seq (/tp under SP), batch, hidden] -> the same shape; `cache` holds (and receives)
        earlier tokens' k, v."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        per_group = self.heads // self.groups
        q, k, v = split_qkv(qkv.view(s, b, self.groups, per_group + 2, self.head_dim))
        q = q.reshape(s, b, self.heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        if rope is not None:
            q, k = apply_rope(q, *rope, fused=self.fused), apply_rope(k, *rope, fused=self.fused)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.max_logits is not None and self.training:
            self.max_logits = torch.maximum(self.max_logits, tracked_max_logits(q, k, self.ctx.cp))
        if cache is not None:
            k, v = cache.append(k, v, self.window)
        if self.recompute_core and self.training:
            out = checkpoint_with_rng(self._core, q, k, v, tracker=self.ctx.rng)
        else:
            out = self._core(q, k, v)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [batch, heads, new, d]; k, v [batch, groups, past + new, d]: new token i sees keys up to past + i.
        Under context parallelism the tokens are this rank's part of the sequence (context_parallel.py)."""
        if self.ctx.cp.size > 1:
            return context_parallel_attention(q, k, v, self.ctx.cp.group, self.ctx.cp_comm, self.window, self.sinks)
        if self.window is not None or self.sinks is not None:
            return windowed_attention(q, k, v, self.window, self.sinks)
        dropout = self.dropout if self.training else 0.0
        past = k.shape[2] - q.shape[2]
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(past) if past else None
        with self.ctx.region_rng():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                                  enable_gqa=self.groups != self.heads)

    def saved_bytes(self, batch: MicroBatch) -> int:
        """The QKV input (this rank's rows under SP), the fused QKV output (v, and q and k without RoPE, are views of
        it), q and k after RoPE, the projection's input, the flash kernel's logsumexp unless the core is recomputed,
        what the q/k norms keep; under all-gather context parallelism `_allgather_change`. Both projections'
        inputs as their recipe keeps them (FP8 `tensorwise`: an FP8 copy; `_projection_input_bytes`)."""
        tokens, c, d = batch.tokens, batch.compute, self.head_dim
        heads, groups = self.heads, self.groups
        size = kept_input_bytes(self.linear_qkv, batch.rows, c) + tokens * (heads + 2 * groups) * d * c
        size += tokens * (heads + groups) * d * c if self.rope else 0
        size += self._projection_input_bytes(batch) + (tokens * heads * 4 if not self.recompute_core else 0)
        return size + self._qk_norm_bytes(batch) + self._allgather_change(batch)

    def _projection_input_bytes(self, batch: MicroBatch) -> int:
        """The projection's input is the core's output (a view of it), which the core keeps unless it is
        recomputed: the projection's own copy (FP8 `tensorwise`'s) is kept beside it, not instead of it."""
        output = batch.tokens * self.heads * self.head_dim * batch.compute
        kept = kept_input_bytes(self.linear_proj, batch.tokens, batch.compute)
        if self.recompute_core:
            return kept
        return output + (kept if kept != output else 0)

    def _qk_norm_bytes(self, batch: MicroBatch) -> int:
        """torch's RMSNorm of each q and k head keeps x * rstd in fp32 and rstd per head, and its input in fp32: in
        fp32 a view of the fused QKV output (counted there) for k, and for q unless grouped-query attention made q
        a copy; in a lower precision an fp32 copy of both."""
        if self.q_norm is None:
            return 0
        tokens, d = batch.tokens, self.head_dim
        rows = tokens * (self.heads + self.groups)
        if batch.compute != 4:
            inputs = rows * d * 4
        else:
            inputs = tokens * self.heads * d * 4 if self.groups != self.heads else 0
        return rows * d * 4 + rows * 4 + inputs

    def _allgather_change(self, batch: MicroBatch) -> int:
        """All-gather context parallelism with nothing recomputed keeps the whole sequence's K/V
        (parallel/context_parallel.py), and with it nothing keeps the fused QKV output nor k after RoPE, except
        what q still keeps: q after RoPE, the copy its reshape makes under grouped-query attention, or else (a
        view) the whole fused QKV output. A signed change to `saved_bytes`."""
        cp = self.ctx.cp.size
        if cp == 1 or self.ctx.cp_comm != "allgather" or self.recompute_core:
            return 0
        tokens, heads, groups = batch.tokens, self.heads, self.groups
        one_device = tokens * (heads + 2 * groups) + (tokens * (heads + groups) if self.rope else 0)
        kept_q = tokens * heads if self.rope or groups != heads else tokens * (heads + 2 * groups)
        gathered = 2 * tokens * groups * cp  # the whole sequence's K/V, per head_dim
        return ((kept_q - one_device) + gathered) * self.head_dim * batch.compute

    def held_bytes(self, batch: MicroBatch) -> int:
        """Both projections' input and output gradient (the QKV input gathered whole under SP), the q/k norms'
        input and output gradient, and the projection's bias gradient, added after the reduction."""
        size = linear_held(self.linear_qkv, batch.tokens, batch.compute)
        size += linear_held(self.linear_proj, batch.tokens, batch.compute)
        if self.q_norm is not None:
            size += recomputed_held(batch.tokens * (self.heads + self.groups) * self.head_dim, batch.compute, batch)
        return size + row_bias_held(self.linear_proj, batch)

    def matmul_parameters(self) -> int:
        return weights_multiplied(self.linear_qkv, self.linear_proj)

    def attention_flops(self, seq: int) -> float:
        """QK^T and the weighted sum over the keys each query is counted against, per token: 2 matmuls x 2 FLOPs."""
        return 4 * attended_keys(seq, self.window) * self.heads * self.head_dim

    def recomputed_flops(self, seq: int) -> float:
        return self.attention_flops(seq) if self.recompute_core else 0


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., groups, per_group + 2, d] -> q [..., groups, per_group, d], k and v [..., groups, d]: views whose
    backward is one concatenation into the fused gradient. Indexing them out instead (a slice and two selects)
    gave three backward nodes that each zero-filled a tensor of the fused size, copied their part in and were
    added together: 17 ms of GPT-2 1.3B's 299 ms step on an H200."""
    q, k, v = qkv.split([qkv.shape[-2] - 2, 1, 1], dim=-2)
    return q, k.squeeze(-2), v.squeeze(-2)


def attended_keys(seq: int, window: int | None) -> float:
    """The keys each token's query is counted against: s (the s x s square, twice the causal pairs) or, under a
    sliding window W < s, as many times the pairs the window keeps (sum over queries of min(q + 1, W)) as the square
    counts the causal pairs, 2 pairs / (s + 1): about 2W at long s."""
    if window is None or window >= seq:
        return seq
    return 2 * (window * seq - window * (window - 1) / 2) / (seq + 1)
