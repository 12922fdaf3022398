"""DeepSeek-V3-class configs between megalite and Hugging Face's DeepseekV3ForCausalLM (DeepSeek-V3/R1, Moonlight,
Kimi K2, whose `model_type: kimi_k2` config is DeepseekV3's read without remote code); hf_config.py and
hf_config_read.py hand such models here, tensors are hf_mapping.py's and hf_mla.py's.

megalite computes the network as family llama (RMSNorm, SwiGLU, RoPE, untied embeddings) with
model.multi_latent_attention and these routing fields: sigmoid scores, the expert bias (HF's
`e_score_correction_bias`) choosing only, group-limited choice by each group's two best scores
(model.moe_router_group_experts=2), renormalised when norm_topk_prob, times routed_scaling_factor, a shared
expert n_shared_experts x moe_intermediate_size wide, the first first_k_dense_replace layers dense.

transformers' latent norms (q_a_layernorm, kv_a_layernorm) have epsilon 1e-6 whatever rms_norm_eps says (Moonlight's
is 1e-5): megalite's model.latent_norm_epsilon, set where it differs from model.norm_epsilon. The multi-token
prediction layers the released checkpoints store as layers num_hidden_layers + d (`model.layers.61.*` in
DeepSeek-V3; `num_nextn_predict_layers` of them) are megalite's model.mtp_num_layers depths (hf_mtp.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from megalite.config import ModelConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
LATENT_NORM_EPSILON = 1e-6  # transformers' (and DeepSeek's reference code's) q_a_layernorm / kv_a_layernorm
RELEASED_GROUP_EXPERTS = 2  # each group scored by its two best experts' scores


def deepseek_fields(hf, source: str) -> dict:
    """The ModelConfig fields of a DeepseekV3 config's latent attention and routing (the rest: hf_config_read)."""
    latent = None if hf.rms_norm_eps == LATENT_NORM_EPSILON else LATENT_NORM_EPSILON
    fields = {"latent_norm_epsilon": latent, "multi_latent_attention": True, "head_dim": None, "num_query_groups": None,
              "q_lora_rank": hf.q_lora_rank, "kv_lora_rank": hf.kv_lora_rank, "qk_head_dim": hf.qk_nope_head_dim,
              "qk_pos_emb_head_dim": hf.qk_rope_head_dim, "v_head_dim": hf.v_head_dim}
    first = min(hf.first_k_dense_replace or 0, hf.num_hidden_layers)
    if first == hf.num_hidden_layers:
        return fields  # every layer dense
    groups = hf.n_group or 1
    group_topk = hf.topk_group or groups
    limited = groups > 1 and group_topk < groups
    return fields | {
        "num_experts": hf.n_routed_experts, "moe_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.moe_intermediate_size, "moe_norm_topk_prob": bool(hf.norm_topk_prob),
        "moe_router": "sigmoid", "moe_expert_bias": True, "moe_scaling_factor": float(hf.routed_scaling_factor),
        "moe_router_groups": groups, "moe_router_group_topk": group_topk if limited else None,
        "moe_router_group_experts": RELEASED_GROUP_EXPERTS if limited else None, "moe_first_dense_layers": first,
        "moe_shared_expert_size": hf.moe_intermediate_size * hf.n_shared_experts}


def check_deepseek(cfg: ModelConfig) -> None:
    """ValueError, naming the field, where `cfg` computes what DeepseekV3ForCausalLM cannot (its features are
    llama's, checked by hf_config.check_hf_features)."""

    def refuse(field: str, value: object, computes: str) -> ValueError:
        return ValueError(f"model.{field}={value}, but {ARCHITECTURE} computes {computes}; this model has no Hugging "
                          "Face equivalent and cannot be converted")

    if cfg.latent_epsilon != LATENT_NORM_EPSILON:
        raise refuse("latent_norm_epsilon", cfg.latent_epsilon, f"its latent norms with epsilon {LATENT_NORM_EPSILON}")
    if not cfg.num_experts:
        return
    if cfg.moe_router != "sigmoid":
        raise refuse("moe_router", cfg.moe_router, "sigmoid scores")
    if cfg.moe_shared_expert_gate:
        raise refuse("moe_shared_expert_gate", "true", "an ungated shared expert")
    if not cfg.moe_shared_expert_size or cfg.moe_shared_expert_size % cfg.expert_ffn_size:
        raise refuse("moe_shared_expert_size", cfg.moe_shared_expert_size,
                     f"a shared expert n_shared_experts >= 1 times moe_intermediate_size={cfg.expert_ffn_size} wide")
    if cfg.moe_layer_freq != 1 and len(cfg.moe_layers) > 1:
        raise refuse("moe_layer_freq", cfg.moe_layer_freq, "experts in every layer after the first dense ones")
    groups, group_topk = cfg.moe_router_groups, cfg.moe_router_group_topk or cfg.moe_router_groups
    group_experts = cfg.moe_router_group_experts or cfg.moe_topk // group_topk
    if groups > 1 and group_topk < groups and group_experts != RELEASED_GROUP_EXPERTS:
        raise refuse("moe_router_group_experts", group_experts, "each group's score as its two best experts' sum")


def deepseek_hf_config(cfg: ModelConfig, common: dict):
    """The DeepseekV3Config of `cfg`; `common`: the fields every rope family shares (hf_config.py), rope
    interleaving on (hf_mla.py writes the rotary rows so, as released), num_nextn_predict_layers the MTP depths."""
    import transformers

    experts = cfg.num_experts > 0
    groups = cfg.moe_router_groups if experts else 1
    fields = {name: common[name] for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "attention_dropout", "initializer_range", "tie_word_embeddings",
        "hidden_act", "bos_token_id", "eos_token_id")}
    return transformers.DeepseekV3Config(
        **fields, num_key_value_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_size,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
        qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=True,
        attention_bias=False, num_mtp_layers=cfg.mtp_num_layers,
        n_routed_experts=cfg.num_experts if experts else 1, num_experts_per_tok=cfg.moe_topk if experts else 1,
        moe_intermediate_size=cfg.expert_ffn_size, first_k_dense_replace=min(cfg.moe_layers, default=cfg.num_layers),
        n_shared_experts=cfg.moe_shared_expert_size // cfg.expert_ffn_size if experts else 1,
        routed_scaling_factor=cfg.moe_scaling_factor, norm_topk_prob=cfg.moe_norm_topk_prob, n_group=groups,
        topk_group=(cfg.moe_router_group_topk or groups) if experts else 1)


def kimi_k2_config(raw: dict):
    """The DeepseekV3Config of Kimi K2's config.json fields (`model_type: kimi_k2` names DeepseekV3's fields, but
    transformers knows the type only through remote code, which megalite never runs)."""
    import transformers

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
    return transformers.DeepseekV3Config.from_dict(fields)


def hub_config(directory: Path):
    """kimi_k2_config of a `model_type: kimi_k2` directory; None for other types."""
    raw = json.loads((directory / "config.json").read_text())
    return kimi_k2_config(raw) if raw.get("model_type") == "kimi_k2" else None
