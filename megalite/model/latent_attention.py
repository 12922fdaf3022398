"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, Moonlight), with Megatron-Core's parameter names.

Per token h (DeepSeek-V3 report, section 2.1):
  queries   c_q = RMSNorm(W_DQ h) (`linear_q_down_proj`, `q_layernorm`), [q_nope; q_rope] = W_UQ c_q per head
            (`linear_q_up_proj`); without query compression (model.q_lora_rank unset) W_Q h (`linear_q_proj`);
  keys/values [c_kv; k_rope] = W_DKV h (`linear_kv_down_proj`), c_kv = RMSNorm(c_kv) (`kv_layernorm`),
            [k_nope; v] = W_UKV c_kv per head (`linear_kv_up_proj`); k_rope, one rotary key, is shared by all heads;
  attention q = [q_nope; RoPE(q_rope)], k = [k_nope; RoPE(k_rope)] (qk head dim = model.qk_head_dim +
            model.qk_pos_emb_head_dim), v per head model.v_head_dim wide (not the qk width); the softmax scale is
            1/sqrt(qk head dim), times mscale(factor, rope_mscale_all_dim)^2 under YaRN (`softmax_scale`).
RoPE rotates halves (model/rope.py), as megalite does everywhere: the released checkpoints' interleaved rotary
channels (`rope_interleave`) are permuted to halves at conversion (checkpoint/hf_mla.py), which gives the same
attention bit for bit.

Tensor parallelism splits the heads: the up-projections are column-parallel and the output projection
row-parallel; the down-projections (parallel/layers.py DuplicatedLinear) and their norms are whole on every rank.
They run on the rank's rows of h: under sequence parallelism its slice of the sequence, so the all-gather before
the up-projections moves the latents (q_lora_rank and kv_lora_rank wide), not the hidden states, and the
down-projections' and norms' gradients are partial over tp, as their placements say; without SP every rank has
every row and gets the whole gradient of the latents from the up-projections' backward all-reduce. The rotary key
enters the heads the same way (gathered under SP, else copied: both sum its gradient over tp).

Context parallelism runs the core through parallel/context_parallel.py with the qk and v widths as they are and
this layer's softmax scale. A generation cache (model/kv_cache.py) keeps per token the compressed latent and the
rotary key (kv_lora_rank + qk_pos_emb_head_dim numbers per layer), and each step expands every cached token's keys
and values again through W_UKV.

Selective recompute (model/recompute.py) reruns the up-projections, the queries' RoPE and the core in backward
(`_attend`, Megatron-Core's mla_up_proj with core_attn): of them autograd keeps only the latents and the rotated
shared key, not q, k and v (heads x (2 (nope + rope) + nope + v) numbers per token). Under the FP8 recipes every
projection runs through parallel/gemm.py with the recipe; the down-projections' tokens are split over the sequence
ranks, over which their scales agree (DuplicatedLinear's operand splits); config_mla.py names the widths blockwise
tiles.

Under MuonClip's QK-clip (training/qk_clip.py) training forwards also track each head's largest logit, at this
layer's softmax scale, against the whole sequence's keys (model/attention.py tracked_max_logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.attention import tracked_max_logits
from megalite.model.costs import MicroBatch, matmul_held, weights_multiplied
from megalite.model.kv_cache import LayerCache
from megalite.model.norms import build_norm
from megalite.model.rope import apply_rope, mscale
from megalite.parallel.context import ParallelContext
from megalite.parallel.context_parallel import context_parallel_attention
from megalite.parallel.layers import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear
from megalite.parallel.mappings import copy_to_tp, gather_from_sp
from megalite.parallel.random import checkpoint_with_rng


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times mscale(rope_scaling_factor, rope_mscale_all_dim)^2 under YaRN (transformers'
    DeepseekV3Attention.scaling; Megatron-Core's MLA softmax_scale)."""
    scale = (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def _padded_to_qk(v: torch.Tensor, qk: int) -> torch.Tensor:
    """v with zero channels up to the query/key width on CPUs, else v itself. The CPU's flash kernel needs v as
    wide as q and k; without it SDPA falls back to the math kernel, which keeps the s x s probabilities (9 GiB per
    layer of DeepSeek-V3 at 4096 tokens). The zero channels add nothing to the weighted sum; the caller drops them.
    CUDA's memory-efficient kernel takes the narrower v as it is (HF's flash-attention path pads alike)."""
    if v.device.type != "cpu" or v.shape[-1] >= qk:
        return v
    return F.pad(v, (0, qk - v.shape[-1]))


class LatentAttention(nn.Module):
    """Each tensor-parallel rank computes heads/tp whole heads."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, device: torch.device) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads // ctx.tp.size
        self.nope, self.rope_dim, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank, heads = cfg.kv_lora_rank, cfg.num_attention_heads
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(cfg.hidden_size, heads * qk, ctx, False)
        else:
            self.linear_q_down_proj = DuplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, ctx)
            self.q_layernorm = build_norm("rmsnorm", cfg.q_lora_rank, cfg.latent_epsilon, device)
            self.linear_q_up_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk, ctx, False)
        self.linear_kv_down_proj = DuplicatedLinear(cfg.hidden_size, self.kv_rank + self.rope_dim, ctx)
        self.kv_layernorm = build_norm("rmsnorm", self.kv_rank, cfg.latent_epsilon, device)
        self.linear_kv_up_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v_dim), ctx, False)
        self.linear_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, ctx, False)
        self.scale, self.dropout, self.ctx = softmax_scale(cfg), cfg.attention_dropout, ctx
        self.recompute_core = False
        self.recompute_up_proj = False  # selective recompute (model/recompute.py): `_attend` whole, core included
        # MuonClip's QK-clip (training/qk_clip.py) sets a tensor here: each head's largest logit since it was reset
        self.max_logits: torch.Tensor | None = None
        self.fused = True  # train.fusions: RoPE as model/fused.py's one kernel each way

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: LayerCache | None = None) -> torch.Tensor:
        """x: [seq (/tp under SP), batch, hidden] -> the same shape; `cache` holds (and receives) earlier tokens'
        normalised latents and rotated keys."""
        queries = self._query_source(x)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_layernorm(latent).to(latent.dtype), self._enter_heads(k_rope)
        k_rope = apply_rope(k_rope.unsqueeze(2), *rope, fused=self.fused)
        if cache is not None:  # cached as [batch, 1, tokens, width]
            latent, k_rope = cache.append(latent.unsqueeze(2).permute(1, 2, 0, 3), k_rope.permute(1, 2, 0, 3))
            latent, k_rope = latent[:, 0].transpose(0, 1), k_rope.permute(2, 0, 1, 3)
        if self.recompute_up_proj and self.training:
            out = checkpoint_with_rng(self._attend, queries, latent, k_rope, *rope, False, tracker=self.ctx.rng)
        else:
            out = self._attend(queries, latent, k_rope, *rope, self.recompute_core and self.training)
        return self.linear_proj(out)

    def _attend(self, queries: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, recompute_core: bool) -> torch.Tensor:
        """The up-projections, the queries' RoPE and the core, from the query source (the normalised query latent,
        or x without query compression), the normalised key/value latent and the rotated shared key: [seq,
        batch, heads/tp * v head dim]. Selective recompute (`recompute_up_proj`) reruns all of it in backward,
        keeping only these inputs (Megatron-Core's mla_up_proj with core_attn)."""
        q = self.linear_q_proj(queries) if hasattr(self, "linear_q_proj") else self.linear_q_up_proj(queries)
        s, b = q.shape[:2]
        q_nope, q_rope = q.view(s, b, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, fused=self.fused)
        kv = self.linear_kv_up_proj(latent)
        k_nope, v = kv.view(*kv.shape[:2], self.heads, -1).split([self.nope, self.v_dim], dim=-1)
        # [batch, heads, seq, width], q and k concatenated straight into that order (contiguous: inductor's
        # attention backward mis-sizes a permuted, concatenated q or k, torch 2.13)
        q_nope, q_rope, k_nope, k_rope, v = (t.permute(1, 2, 0, 3) for t in (q_nope, q_rope, k_nope, k_rope, v))
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.heads, -1, -1)), dim=-1)
        if self.max_logits is not None and self.training:  # rerun by a recompute too: the same maximum
            self.max_logits = torch.maximum(self.max_logits, tracked_max_logits(q, k, self.ctx.cp, self.scale))
        if recompute_core:
            out = checkpoint_with_rng(self._core, q, k, v, tracker=self.ctx.rng)
        else:
            out = self._core(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)

    def query_projection(self) -> str:
        """The name of the projection whose rows are the heads' queries, [q_nope; q_rope] per head."""
        return "linear_q_proj" if hasattr(self, "linear_q_proj") else "linear_q_up_proj"

    def _query_source(self, x: torch.Tensor) -> torch.Tensor:
        """What the query (up-)projection takes: x without query compression, else the normalised query latent
        of this rank's rows (the column-parallel up-projection gathers it under SP)."""
        if hasattr(self, "linear_q_proj"):
            return x
        c_q = self.linear_q_down_proj(x)
        return self.q_layernorm(c_q).to(c_q.dtype)

    def _enter_heads(self, k_rope: torch.Tensor) -> torch.Tensor:
        """The shared rotary key of this rank's rows, for every row's heads: gathered along the sequence under SP,
        else as is; either way its gradient is summed over the tensor-parallel ranks' heads in backward."""
        group = self.ctx.tp.group
        return gather_from_sp(k_rope, group) if self.ctx.sequence_parallel else copy_to_tp(k_rope, group)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k [batch, heads, new or past + new, qk dim], v [..., v dim]: new token i sees keys up to past + i."""
        if self.ctx.cp.size > 1:
            return context_parallel_attention(q, k, v, self.ctx.cp.group, self.ctx.cp_comm, scale=self.scale)
        dropout = self.dropout if self.training else 0.0
        past = k.shape[2] - q.shape[2]
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(past) if past else None
        narrow = _padded_to_qk(v, q.shape[-1])
        with self.ctx.region_rng():
            out = F.scaled_dot_product_attention(q, k, narrow, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=mask is None, scale=self.scale)
        return out[..., :v.shape[-1]] if narrow is not v else out

    def _linears(self) -> list[nn.Module]:
        return [m for m in self.children() if isinstance(m, (ColumnParallelLinear, RowParallelLinear,
                                                             DuplicatedLinear))]

    def saved_bytes(self, batch: MicroBatch) -> int:
        """Each projection's input (the down-projections' on this rank's rows, the others' on every token), the
        norms' fp32 input and statistics; then, with the up-projections recomputed (`_attend` checkpointed), only
        the rotated shared key beside them; else q and k after the concatenation, the up-projection's output of
        which v is a view, and the core's logsumexp (unless the core is recomputed: then q, k, v are its kept
        inputs all the same); under all-gather context parallelism `_allgather_change`."""
        tokens, c, heads, qk = batch.tokens, batch.compute, self.heads, self.nope + self.rope_dim
        size = sum((batch.rows if isinstance(lin, DuplicatedLinear) else tokens) * lin.weight.shape[1] * c
                   for lin in self._linears())
        norms = [self.kv_rank] + ([self.linear_q_down_proj.weight.shape[0]] if hasattr(self, "q_layernorm") else [])
        size += sum(batch.rows * (width * 4 + 4) for width in norms)
        if self.recompute_up_proj:
            return size + tokens * self.rope_dim * c
        size += tokens * heads * (2 * qk + self.nope + self.v_dim) * c
        if self.recompute_core:
            return size + self._allgather_change(batch)
        return size + tokens * heads * 4 + self._cpu_padding(batch) + self._allgather_change(batch)

    def _cpu_padding(self, batch: MicroBatch) -> int:
        """On CPUs (`_padded_to_qk`) the core also keeps v padded to the qk width and its output as wide, apart
        from the output projection's input (the narrow part, copied out of it)."""
        qk = self.nope + self.rope_dim
        if batch.device != "cpu" or self.v_dim >= qk or self.ctx.cp.size > 1:
            return 0
        return 2 * batch.tokens * self.heads * qk * batch.compute

    def _allgather_change(self, batch: MicroBatch) -> int:
        """All-gather context parallelism with the core not recomputed keeps the whole sequence's packed K/V
        (parallel/context_parallel.py) instead of k and the up-projection's output (v's storage)."""
        cp = self.ctx.cp.size
        if cp == 1 or self.ctx.cp_comm != "allgather" or self.recompute_core:
            return 0
        qk, v = self.nope + self.rope_dim, self.v_dim
        return batch.tokens * self.heads * (cp * (qk + v) - qk - (self.nope + v)) * batch.compute

    def held_bytes(self, batch: MicroBatch) -> int:
        """Every projection's input and output gradient (the down-projections' on this rank's rows)."""
        return sum(matmul_held(lin.weight, batch.rows if isinstance(lin, DuplicatedLinear) else batch.tokens,
                               batch.compute) for lin in self._linears())

    def matmul_parameters(self) -> int:
        return weights_multiplied(*self._linears())

    def attention_flops(self, seq: int) -> float:
        """QK^T over the qk width and the weighted sum over the v width, for the s x s square, per token."""
        return 2 * seq * self.heads * (self.nope + self.rope_dim + self.v_dim)

    def recomputed_flops(self, seq: int) -> float:
        """The core's FLOPs under selective recompute, and the up-projections' with it when they rerun."""
        if self.recompute_up_proj:
            up = (getattr(self, self.query_projection()), self.linear_kv_up_proj)
            return self.attention_flops(seq) + 2 * weights_multiplied(*up)
        return self.attention_flops(seq) if self.recompute_core else 0
