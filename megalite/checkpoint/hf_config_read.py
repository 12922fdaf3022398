"""The megalite model config of a Hugging Face config (the other way: hf_config.py).

HF model types map to megalite families: gpt2; llama, mistral (the Llama architecture) and mixtral to llama;
qwen2 and qwen2_moe to qwen2; qwen3 and qwen3_moe to qwen3; gpt_oss to gpt_oss; deepseek_v3 and kimi_k2 to llama
with latent attention and DeepSeek-V3's routing (hf_deepseek.py). Sliding windows come with them
(Mistral-7B-v0.1's 4096 of 32768 positions; Qwen's max_window_layers and every class's layer_types as the layers
they cover; a window as long as the context is no window). An HF config describing something megalite does not
compute (an activation other than GELU, SiLU and quick GELU, Llama's biases, RoPE scaling other than Llama 3's and
YaRN, a layer type other than full and sliding attention, router jitter, DeepSeek-V2's routing, ...) is refused
with the reason.

What only shapes training is not part of the network: HF's router_aux_loss_coef pools every layer's router
into one balancing loss, megalite's model.moe_aux_loss_coeff weighs one loss per layer (Megatron's), so the
coefficient is not carried over either way; set model.moe_aux_loss_coeff for continued pretraining.
"""

from __future__ import annotations

from megalite.checkpoint.hf_config import ARCHITECTURES, HF_ACTIVATIONS, SWIGLU_ALPHAS
from megalite.checkpoint.hf_deepseek import MODEL_TYPES as DEEPSEEK_TYPES
from megalite.checkpoint.hf_deepseek import deepseek_fields
from megalite.config import ModelConfig

# HF model types megalite does not convert, with what they compute that megalite does not.
UNSUPPORTED = {
    "deepseek_v2": "DeepSeek-V2's softmax-scored routing (megalite converts its MLA only as DeepSeek-V3's)",
    "olmoe": "a q/k norm over all heads together, not per head",
}

# HF model type -> megalite family (Mistral is the Llama architecture; a megalite llama exports as Llama).
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
            "qwen2_moe": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss",
            **{model_type: "llama" for model_type in DEEPSEEK_TYPES}}

# HF config field -> the values megalite computes (the first is what it writes); anything else changes the network.
_FIXED = {
    "gpt2": {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
             "add_cross_attention": (False,)},
    "llama": {"attention_bias": (False,), "mlp_bias": (False,)},
    "mixtral": {"router_jitter_noise": (0.0,)},
    "qwen2_moe": {"qkv_bias": (True,)},
    "qwen3": {"attention_bias": (False,)},
    "qwen3_moe": {"attention_bias": (False,)},
    "gpt_oss": {"attention_bias": (True,)},
    **{model_type: {"attention_bias": (False,)} for model_type in DEEPSEEK_TYPES},
}


def _check_fixed(hf, source: str) -> None:
    for name, allowed in _FIXED.get(hf.model_type, {}).items():
        value = getattr(hf, name, allowed[0])
        if value not in allowed:
            raise ValueError(f"{source}: {name}={value!r}, but megalite's {hf.model_type} computes "
                             f"{name}={allowed[0]!r}; this model cannot be converted")


def _activation(hf, source: str) -> str:
    """megalite's model.activation for HF's activation_function (GPT-2), swiglu_alpha (gpt-oss) or hidden_act."""
    if hf.model_type == "gpt_oss":
        for activation, alpha in SWIGLU_ALPHAS.items():
            if hf.swiglu_alpha == alpha:
                return activation
        raise ValueError(f"{source}: swiglu_alpha={hf.swiglu_alpha}, but megalite's gpt_oss computes swiglu_alpha="
                         f"{' or '.join(map(str, SWIGLU_ALPHAS.values()))}; this model cannot be converted")
    name = "activation_function" if hf.model_type == "gpt2" else "hidden_act"
    value = getattr(hf, name)
    for activation, names in HF_ACTIVATIONS.items():
        if value in names:
            return activation
    known = [repr(n) for names in HF_ACTIVATIONS.values() for n in names]
    raise ValueError(f"{source}: {name}={value!r}, but megalite's {hf.model_type} computes {name}={known[0]}, "
                     f"{', '.join(known[1:-1])} or {known[-1]}; this model cannot be converted")


def _windows(hf, source: str) -> dict:
    """model.sliding_window and sliding_window_layers: the layers layer_types calls sliding_attention, or every
    layer (Mistral, Mixtral, Qwen3-MoE) when the config has a window; none that is as long as the context."""
    types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{source}: layer_types has {unknown}; megalite computes full_attention and "
                             "sliding_attention only")
        layers = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    else:
        layers = list(range(hf.num_hidden_layers))
    if not window or window >= hf.max_position_embeddings or not layers:
        return {}
    return {"sliding_window": window,
            "sliding_window_layers": None if len(layers) == hf.num_hidden_layers else layers}


def model_config_from_hf(hf, source: str) -> ModelConfig:
    """The megalite ModelConfig of a transformers config of a model type in FAMILIES (`source` names it in
    errors). seq_length is the model's context (max_position_embeddings); override it for training."""
    if hf.model_type in UNSUPPORTED:
        raise ValueError(f"{source}: model_type={hf.model_type!r} computes {UNSUPPORTED[hf.model_type]}, which "
                         "megalite does not; this model cannot be converted")
    if hf.model_type not in FAMILIES:
        raise ValueError(f"{source}: model_type={hf.model_type!r}; megalite converts "
                         + ", ".join(sorted(FAMILIES)) + f" ({', '.join(ARCHITECTURES.values())})")
    _check_fixed(hf, source)
    if hf.model_type == "gpt2":
        return ModelConfig(
            family="gpt2", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
            ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, seq_length=hf.n_positions,
            max_position_embeddings=hf.n_positions, vocab_size=hf.vocab_size, tie_embeddings=hf.tie_word_embeddings,
            norm_epsilon=hf.layer_norm_epsilon, init_std=hf.initializer_range, hidden_dropout=hf.resid_pdrop,
            attention_dropout=hf.attn_pdrop, activation=_activation(hf, source),
        )
    fields = deepseek_fields(hf, source) if hf.model_type in DEEPSEEK_TYPES else _experts(hf, source)
    return _rope_model(hf, source, **_windows(hf, source), **_rope_fields(hf, source), **fields)


def _rope_fields(hf, source: str) -> dict:
    """rope_theta, and Llama 3's frequency scaling (rope_type llama3, as Llama-3.1 and 3.2 have it) or YaRN's
    (gpt-oss)."""
    rope = hf.rope_parameters or {}
    fields = {"rope_theta": float(rope.get("rope_theta", 10000.0))}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}; "
                         "megalite rotates the whole head")
    kind = rope.get("rope_type", "default")
    if kind == "llama3":
        return fields | {"rope_scaling": "llama3", "rope_scaling_factor": float(rope["factor"]),
                         "rope_low_freq_factor": float(rope["low_freq_factor"]),
                         "rope_high_freq_factor": float(rope["high_freq_factor"]),
                         "rope_original_max_positions": int(rope["original_max_position_embeddings"])}
    if kind == "yarn":
        return fields | _yarn_fields(hf, rope, source)
    if kind != "default":
        raise ValueError(f"{source}: rope_parameters.rope_type={kind!r}; megalite implements plain RoPE (default), "
                         "Llama 3's scaling (llama3) and YaRN (yarn) only")
    return fields


def _yarn_fields(hf, rope: dict, source: str) -> dict:
    """YaRN's parameters as transformers reads them (its defaults where absent; no factor: the context's growth)."""
    if rope.get("attention_factor") is not None:
        raise ValueError(f"{source}: rope_parameters.attention_factor={rope['attention_factor']}; megalite derives "
                         "YaRN's scale of cos and sin from factor, mscale and mscale_all_dim only")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf.max_position_embeddings / original
    return {"rope_scaling": "yarn", "rope_scaling_factor": float(factor), "rope_original_max_positions": original,
            "rope_beta_fast": float(rope.get("beta_fast") or 32), "rope_beta_slow": float(rope.get("beta_slow") or 1),
            "rope_mscale": rope.get("mscale"), "rope_mscale_all_dim": rope.get("mscale_all_dim"),
            "rope_truncate": bool(rope.get("truncate", True))}


def _experts(hf, source: str) -> dict:
    """The ModelConfig fields of a Mixtral's, Qwen2-MoE's, Qwen3-MoE's or gpt-oss's routed experts (none for dense
    models): gpt-oss's router takes the top k of its logits and a softmax over those, the softmax over all
    renormalised over the k chosen, as Mixtral's."""
    if hf.model_type in ("mixtral", "gpt_oss"):
        clamp = {"glu_limit": float(hf.swiglu_limit)} if hf.model_type == "gpt_oss" else {}
        return {"num_experts": hf.num_local_experts, "moe_topk": hf.num_experts_per_tok,
                "moe_ffn_hidden_size": hf.intermediate_size, "moe_norm_topk_prob": True, **clamp}
    if hf.model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    # the expert layers: every decoder_sparse_step-th (counted from 1) but those in mlp_only_layers
    layers = [i for i in range(hf.num_hidden_layers)
              if i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0]
    if not layers:
        return {}  # a dense network
    fields = {"num_experts": hf.num_experts, "moe_topk": hf.num_experts_per_tok,
              "moe_ffn_hidden_size": hf.moe_intermediate_size, "moe_norm_topk_prob": hf.norm_topk_prob,
              "moe_first_dense_layers": layers[0],
              "moe_layer_freq": layers[1] - layers[0] if len(layers) > 1 else hf.num_hidden_layers}
    if hf.model_type == "qwen2_moe":  # its shared expert, scaled by a sigmoid gate
        fields |= {"moe_shared_expert_size": hf.shared_expert_intermediate_size, "moe_shared_expert_gate": True}
    placed = ModelConfig(num_layers=hf.num_hidden_layers, **fields)
    if list(placed.moe_layers) != layers:
        raise ValueError(f"{source}: experts in layers {layers} (decoder_sparse_step={hf.decoder_sparse_step}, "
                         f"mlp_only_layers={hf.mlp_only_layers}); megalite puts experts in every moe_layer_freq-th "
                         "layer after the first moe_first_dense_layers and cannot place them there")
    return fields


def _rope_model(hf, source: str, **fields) -> ModelConfig:
    """A Llama, Mistral, Mixtral, Qwen2(-MoE), Qwen3(-MoE) or gpt-oss config: attention, norms, embeddings, then
    `fields` (windows', RoPE's, the experts')."""
    head_dim = getattr(hf, "head_dim", None)
    derived = hf.hidden_size // hf.num_attention_heads if hf.hidden_size % hf.num_attention_heads == 0 else None
    return ModelConfig(**dict(
        family=FAMILIES[hf.model_type], num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, head_dim=None if head_dim in (None, derived) else head_dim,
        num_query_groups=hf.num_key_value_heads or hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
        seq_length=hf.max_position_embeddings, max_position_embeddings=hf.max_position_embeddings,
        vocab_size=hf.vocab_size, tie_embeddings=hf.tie_word_embeddings, norm_epsilon=hf.rms_norm_eps,
        init_std=hf.initializer_range, attention_dropout=hf.attention_dropout, activation=_activation(hf, source),
    ) | fields)
