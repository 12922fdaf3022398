"""Multi-head latent attention's tensors between megalite (Megatron-Core's names, model/latent_attention.py) and
Hugging Face's DeepseekV3 (DeepSeek-V3/R1, Kimi K2, Moonlight).

One layout difference, handled here only: the released checkpoints store each head's rotary query channels and the
shared rotary key's in interleaved pairs (x0 x1)(x2 x3)... (`rope_interleave: true`), which transformers rotates
pairwise; megalite rotates halves everywhere (model/rope.py). Reading, those rows are permuted to halves (the even
channels, then the odd ones), which gives the very scores transformers computes; writing, they are permuted back
and `rope_interleave: true` is written, so a released checkpoint's tensors round-trip bit for bit. Megatron-Core's
MLA takes its projections' rotary rows in the same interleaved order: its import (checkpoint/megatron/mla.py)
applies the same permutation.
"""

from __future__ import annotations

import torch

from megalite.config import ModelConfig

StateDict = dict[str, torch.Tensor]

# megalite's name (in layers.{i}.attention.) -> HF's (in model.layers.{i}.self_attn.)
_NAMES = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
          "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
          "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}


def _present(cfg: ModelConfig) -> list[str]:
    query = ["linear_q_proj"] if cfg.q_lora_rank is None else ["linear_q_down_proj", "q_layernorm", "linear_q_up_proj"]
    return query + ["linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj", "linear_proj"]


def halves_order(rope: int) -> torch.Tensor:
    """The order that takes interleaved rotary channels to halves: the even ones, then the odd ones."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


def permute_rope_rows(w: torch.Tensor, cfg: ModelConfig, name: str, order: torch.Tensor) -> torch.Tensor:
    """`w` with the rotary rows of each head (queries) or of the shared key reordered by `order`."""
    rope = cfg.qk_pos_emb_head_dim
    if name in ("linear_q_proj", "linear_q_up_proj"):
        heads = w.view(cfg.num_attention_heads, cfg.qk_head_dim + rope, -1)
        nope, rot = heads.split([cfg.qk_head_dim, rope], dim=1)
        return torch.cat((nope, rot[:, order]), dim=1).flatten(0, 1)
    if name == "linear_kv_down_proj":
        latent, rot = w.split([cfg.kv_lora_rank, rope])
        return torch.cat((latent, rot[order]))
    return w


def mla_from_hf(hf: StateDict, cfg: ModelConfig, i: int, interleaved: bool) -> StateDict:
    """Layer i's attention tensors in megalite's names; `interleaved`: the HF config's rope_interleave."""
    order = halves_order(cfg.qk_pos_emb_head_dim)
    out = {}
    for name in _present(cfg):
        w = hf[f"model.layers.{i}.self_attn.{_NAMES[name]}.weight"]
        out[f"layers.{i}.attention.{name}.weight"] = permute_rope_rows(w, cfg, name, order) if interleaved else w
    return out


def mla_to_hf(state: StateDict, cfg: ModelConfig, i: int) -> StateDict:
    """Layer i's attention tensors in HF's names, the rotary rows interleaved (write rope_interleave: true)."""
    order = torch.argsort(halves_order(cfg.qk_pos_emb_head_dim))
    return {f"model.layers.{i}.self_attn.{_NAMES[name]}.weight":
            permute_rope_rows(state[f"layers.{i}.attention.{name}.weight"], cfg, name, order)
            for name in _present(cfg)}
