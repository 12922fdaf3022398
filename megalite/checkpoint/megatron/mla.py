"""DeepSeek-V3-class Megatron-LM checkpoints: multi-latent attention's and multi-token prediction's config from
Megatron's `args`, and the one layout difference of their tensors.

Megatron-Core's MLA (`--multi-latent-attention`, MLATransformerConfig) keeps megalite's meanings and names:
`q_lora_rank` (unset: no query compression, `linear_q_proj`), `kv_lora_rank`, `qk_head_dim` (the part without
RoPE), `qk_pos_emb_head_dim`, `v_head_dim`; its latent norms exist only with `--qk-layernorm` (otherwise
Megatron runs the latents unnormalised, which neither megalite nor DeepSeek computes) and take the model's
normalization over the whole latent, with the model's epsilon. Its rotary positions are its own (the GPT's RoPE
and `--use-rope-scaling` do not reach MLA): `--rope-type` yarn by default, which with `--rotary-scaling-factor`
1 (the argument's default) is plain RoPE, else YaRN with that factor, MLATransformerConfig's fixed original
context 4096 and beta_fast 32 / beta_slow 1, correction bounds rounded outwards, cos and sin scaled by
mscale(factor, `--mscale`) / mscale(factor, `--mscale-all-dim`) and the softmax by mscale(factor,
`--mscale-all-dim`)^2 (yarn_rotary_pos_embedding.py, multi_latent_attention.py), as megalite's yarn fields.

Rotary channels: Megatron's MLA takes each head's rotary query channels and the shared rotary key, as the
projections produce them, in interleaved pairs (x0 x1)(x2 x3)... and splits them into halves before rotating
halves (rope_utils.py `mla_rotary_interleaved`): the released DeepSeek-V3 layout.
megalite rotates halves of channels stored as halves, so `to_megalite_layout` permutes those rows (of the query
projection per head and of kv_down_proj's rotary part [c_kv; k_rope]) with hf_mla.py's permutation, the weights
and every optimizer state alike: the same scores, bit for bit.

Multi-token prediction (`--mtp-num-layers`, `--mtp-loss-scaling-factor`) maps one-to-one: Megatron's depth is
enorm, hnorm, eh_proj over [embedding; hidden] (the main model's normed output), one transformer layer of the
last decoder layer's kind, and its own final norm, the embedding and output head shared.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megalite.checkpoint.hf_mla import halves_order, permute_rope_rows
from megalite.checkpoint.megatron.state import arg
from megalite.config import ModelConfig

YARN_ORIGINAL_POSITIONS, YARN_BETA_FAST, YARN_BETA_SLOW = 4096, 32.0, 1.0  # MLATransformerConfig's defaults
ROTARY_ROWS = ("linear_q_proj", "linear_q_up_proj", "linear_kv_down_proj")


def _rope_fields(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """megalite's RoPE scaling fields of Megatron's MLA rotary embedding (module docstring)."""
    factor = float(arg(args, "rotary_scaling_factor", 1.0))
    if (arg(args, "rope_type") or "yarn") != "yarn" or factor == 1.0:
        return {"rope_scaling": "none"}
    m, m_all = float(arg(args, "mscale", 1.0)), float(arg(args, "mscale_all_dim", 0.0))
    if factor < 1.0:
        problems.append(f"args.rotary_scaling_factor={factor} (YaRN's factor must be >= 1)")
    if not (m and m_all) and (m, m_all) != (1.0, 0.0):
        problems.append(f"args.mscale={m} with args.mscale_all_dim={m_all} (megalite scales cos and sin by "
                        "mscale(factor, mscale) / mscale(factor, mscale_all_dim) with both set, or by "
                        "mscale(factor, 1) with neither)")
    return {"rope_scaling": "yarn", "rope_scaling_factor": factor,
            "rope_original_max_positions": YARN_ORIGINAL_POSITIONS, "rope_beta_fast": YARN_BETA_FAST,
            "rope_beta_slow": YARN_BETA_SLOW, "rope_truncate": True,
            "rope_mscale": m if m_all else None, "rope_mscale_all_dim": m_all or None}


def mla_fields(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """ModelConfig's fields of Megatron's multi-latent attention (none without it), overriding the attention
    fields args.py reads for other models; what megalite does not compute is added to `problems`."""
    if not arg(args, "multi_latent_attention", False):
        return {}
    if not arg(args, "qk_layernorm", False):
        problems.append("args.multi_latent_attention=True without args.qk_layernorm (Megatron's latents are then "
                        "not normalised; megalite's, as DeepSeek's, are)")
    if args.normalization != "RMSNorm":
        problems.append(f"args.normalization={args.normalization!r} with args.multi_latent_attention (its latent "
                        "norms are then LayerNorms; megalite's are RMSNorm)")
    if arg(args, "mla_down_proj_fusion", False):
        problems.append("args.mla_down_proj_fusion=True (the fused linear_qkv_down_proj is not read; a run "
                        "without --mla-down-proj-fusion saves linear_q_down_proj and linear_kv_down_proj)")
    if args.position_embedding_type != "rope":
        problems.append(f"args.position_embedding_type={args.position_embedding_type!r} with "
                        "args.multi_latent_attention (megalite's MLA has rotary positions only)")
    return {"multi_latent_attention": True, "q_lora_rank": arg(args, "q_lora_rank"),
            "kv_lora_rank": args.kv_lora_rank, "qk_head_dim": args.qk_head_dim,
            "qk_pos_emb_head_dim": args.qk_pos_emb_head_dim, "v_head_dim": args.v_head_dim,
            "head_dim": None, "num_query_groups": None, "qk_norm": False, **_rope_fields(args, problems)}


def mtp_fields(args: argparse.Namespace, moe: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """ModelConfig's multi-token-prediction fields (none without it); `moe`: the MoE fields (moe_args.py), whose
    layer pattern must give each depth the kind Megatron gave it."""
    depths = arg(args, "mtp_num_layers") or 0
    if not depths:
        return {}
    if arg(args, "mtp_use_repeated_layer", False):
        problems.append("args.mtp_use_repeated_layer=True (one layer's weights for every depth; megalite's depths "
                        "each have their own)")
    if arg(args, "mtp_detach_heads", False):
        problems.append("args.mtp_detach_heads=True (megalite's depths train the shared embedding and head)")
    if moe.get("num_experts"):
        first, every, layers = moe["moe_first_dense_layers"], moe["moe_layer_freq"], args.num_layers
        kind = [i >= first and (i - first) % every == 0 for i in (layers - 1, *range(layers, layers + depths))]
        if any(k != kind[0] for k in kind[1:]):
            problems.append(f"args.mtp_num_layers={depths} with args.moe_layer_freq={arg(args, 'moe_layer_freq')} "
                            f"(Megatron's prediction layers are of the last decoder layer's kind, megalite's of "
                            f"layers {layers}.. by the same pattern, which differs)")
    return {"mtp_num_layers": depths, "mtp_loss_scaling_factor": float(arg(args, "mtp_loss_scaling_factor", 0.1))}


def to_megalite_layout(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """megalite's tensor `name` (a weight or an optimizer state of it) from Megatron's layout: the rotary rows
    of MLA's query projection and kv_down_proj from interleaved pairs to halves (module docstring)."""
    if not cfg.multi_latent_attention or ".attention." not in name:
        return tensor
    module = name.rsplit(".", 2)[-2]
    if module not in ROTARY_ROWS:
        return tensor
    return permute_rope_rows(tensor, cfg, module, halves_order(cfg.qk_pos_emb_head_dim))
