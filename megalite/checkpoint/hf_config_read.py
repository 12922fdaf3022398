"""The megalite model config of a Hugging Face config (the other way: hf_config.py).

HF model types map to megalite families: gpt2; llama, mistral (the Llama architecture) and mixtral to llama;
qwen2 and qwen2_moe to qwen2; qwen3 and qwen3_moe to qwen3. An HF config describing something megalite does
not compute (an activation other than GELU and SiLU, Llama's biases, RoPE scaling other than Llama 3's, a
sliding window shorter than the context, router jitter, MLA, attention sinks, ...) is refused with the reason.

What only shapes training is not part of the network: HF's router_aux_loss_coef pools every layer's router
into one balancing loss, megalite's model.moe_aux_loss_coeff weighs one loss per layer (Megatron's), so the
coefficient is not carried over either way; set model.moe_aux_loss_coeff for continued pretraining.
"""

from __future__ import annotations

from megalite.checkpoint.hf_config import ARCHITECTURES, HF_ACTIVATIONS
from megalite.config import ModelConfig

# HF model types megalite does not convert, with what they compute that megalite does not.
UNSUPPORTED = {
    "deepseek_v2": "multi-head latent attention (MLA)",
    "deepseek_v3": "multi-head latent attention (MLA) and a router choosing experts by score plus a learned bias",
    "gpt_oss": "attention sinks and biases in the router and the experts",
    "olmoe": "a q/k norm over all heads together, not per head",
}

# HF model type -> megalite family (Mistral is the Llama architecture; a megalite llama exports as Llama).
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
            "qwen2_moe": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3"}

# HF config field -> the values megalite computes (the first is what it writes); anything else changes the network.
_FIXED = {
    "gpt2": {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
             "add_cross_attention": (False,)},
    "llama": {"attention_bias": (False,), "mlp_bias": (False,)},
    "mixtral": {"router_jitter_noise": (0.0,)},
    "qwen2_moe": {"qkv_bias": (True,)},
    "qwen3": {"attention_bias": (False,)},
    "qwen3_moe": {"attention_bias": (False,)},
}


def _check_fixed(hf, source: str) -> None:
    for name, allowed in _FIXED.get(hf.model_type, {}).items():
        value = getattr(hf, name, allowed[0])
        if value not in allowed:
            raise ValueError(f"{source}: {name}={value!r}, but megalite's {hf.model_type} computes "
                             f"{name}={allowed[0]!r}; this model cannot be converted")


def _activation(hf, source: str) -> str:
    """megalite's model.activation for HF's activation_function (GPT-2) or hidden_act (the others)."""
    name = "activation_function" if hf.model_type == "gpt2" else "hidden_act"
    value = getattr(hf, name)
    for activation, names in HF_ACTIVATIONS.items():
        if value in names:
            return activation
    known = [repr(n) for names in HF_ACTIVATIONS.values() for n in names]
    raise ValueError(f"{source}: {name}={value!r}, but megalite's {hf.model_type} computes {name}={known[0]}, "
                     f"{', '.join(known[1:-1])} or {known[-1]}; this model cannot be converted")


def _check_full_attention(hf, source: str) -> None:
    """Every layer attends to the whole causal prefix: no layer type other than full attention, no sliding
    window shorter than the model's context (Mistral-7B-v0.1's 4096 of 32768 is refused, v0.3's none maps)."""
    types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if types is not None:
        windowed = [i for i, kind in enumerate(types) if kind != "full_attention"]
    else:
        windowed = [] if window is None or window >= hf.max_position_embeddings else list(range(hf.num_hidden_layers))
    if windowed:
        raise ValueError(f"{source}: layers {windowed} attend through a sliding window (sliding_window={window}, "
                         f"layer_types={types}, max_position_embeddings={hf.max_position_embeddings}); megalite "
                         "computes full causal attention only")


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
    _check_full_attention(hf, source)
    return _rope_model(hf, source, **_rope_fields(hf, source), **_experts(hf, source))


def _rope_fields(hf, source: str) -> dict:
    """rope_theta, and Llama 3's frequency scaling (rope_type llama3, as Llama-3.1 and 3.2 have it)."""
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
    if kind != "default":
        raise ValueError(f"{source}: rope_parameters.rope_type={kind!r}; megalite implements plain RoPE (default) "
                         "and Llama 3's scaling (llama3) only")
    return fields


def _experts(hf, source: str) -> dict:
    """The ModelConfig fields of a Mixtral's, Qwen2-MoE's or Qwen3-MoE's routed experts (none for dense models)."""
    if hf.model_type == "mixtral":
        return {"num_experts": hf.num_local_experts, "moe_topk": hf.num_experts_per_tok,
                "moe_ffn_hidden_size": hf.intermediate_size, "moe_norm_topk_prob": True}
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
    """A Llama, Mistral, Mixtral, Qwen2(-MoE) or Qwen3(-MoE) config: attention, norms, embeddings, then `fields`
    (RoPE's, the experts')."""
    head_dim = getattr(hf, "head_dim", None)
    derived = hf.hidden_size // hf.num_attention_heads if hf.hidden_size % hf.num_attention_heads == 0 else None
    return ModelConfig(
        family=FAMILIES[hf.model_type], num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, head_dim=None if head_dim in (None, derived) else head_dim,
        num_query_groups=hf.num_key_value_heads or hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
        seq_length=hf.max_position_embeddings, max_position_embeddings=hf.max_position_embeddings,
        vocab_size=hf.vocab_size, tie_embeddings=hf.tie_word_embeddings, norm_epsilon=hf.rms_norm_eps,
        init_std=hf.initializer_range, attention_dropout=hf.attention_dropout, activation=_activation(hf, source),
        **fields,
    )
