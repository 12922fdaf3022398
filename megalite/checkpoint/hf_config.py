"""The Hugging Face architecture of a megalite model, and the configs both ways.

The family and whether the model has routed experts pick the transformers class: gpt2 is GPT2LMHeadModel,
llama is LlamaForCausalLM (MixtralForCausalLM with experts), qwen3 is Qwen3ForCausalLM (Qwen3MoeForCausalLM
with experts). A config only maps when both sides compute the same network: an HF config describing
something megalite does not compute (an activation other than GELU and SiLU, Llama's biases, RoPE scaling,
sliding windows, router jitter, MLA, attention sinks, ...) is refused with the reason, and so is a megalite model whose
features or expert routing its HF class cannot express (a Llama with biases, a sigmoid router, a shared
expert, a Mixtral with dense layers). Nothing is ever converted into a different network.

What only shapes training is not part of the network: HF's router_aux_loss_coef pools every layer's router
into one balancing loss, megalite's model.moe_aux_loss_coeff weighs one loss per layer (Megatron's), so the
coefficient is not carried over either way; set model.moe_aux_loss_coeff for continued pretraining.
"""

from __future__ import annotations

import dataclasses

from megalite.config import FAMILY_FEATURES, ModelConfig

# (family, has experts) -> the transformers class computing that network.
ARCHITECTURES = {
    ("gpt2", False): "GPT2LMHeadModel", ("llama", False): "LlamaForCausalLM", ("llama", True): "MixtralForCausalLM",
    ("qwen3", False): "Qwen3ForCausalLM", ("qwen3", True): "Qwen3MoeForCausalLM",
}

# HF model types megalite does not convert, with what they compute that megalite does not.
UNSUPPORTED = {
    "deepseek_v2": "multi-head latent attention (MLA)",
    "deepseek_v3": "multi-head latent attention (MLA) and a router choosing experts by score plus a learned bias",
    "gpt_oss": "attention sinks and biases in the router and the experts",
    "qwen2_moe": "biases on q/k/v only (model.bias puts them in every linear layer)",
    "olmoe": "a q/k norm over all heads together, not per head",
}


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers class name of `cfg`'s network; ValueError when there is none."""
    key = (cfg.family, cfg.num_experts > 0)
    if key not in ARCHITECTURES:
        raise ValueError(f"model.family={cfg.family} with model.num_experts={cfg.num_experts} has no Hugging Face "
                         "architecture megalite maps (experts map for llama: Mixtral, and qwen3: Qwen3-MoE); "
                         "this model cannot be converted")
    return ARCHITECTURES[key]


# megalite's model.activation -> its names in HF's activation_function (GPT-2) / hidden_act (the others); the first
# is what megalite writes. HF's gelu_new computes the tanh approximation in separate ops: equal to round-off.
HF_ACTIVATIONS = {"gelu_tanh": ("gelu_new", "gelu_pytorch_tanh"), "gelu": ("gelu",), "silu": ("silu", "swish")}

# Features every HF class expresses both ways; the others must be the family's.
_FREE_FEATURES = ("tie_embeddings", "activation")


def _refuse(field: str, value: object, architecture: str, computes: object, family: str) -> ValueError:
    return ValueError(f"model.{field}={str(value).lower()}, but {architecture} (model.family={family}) computes "
                      f"{field}={str(computes).lower()}; this model has no Hugging Face equivalent and cannot be "
                      "converted")


def check_hf_features(cfg: ModelConfig) -> None:
    """Raise ValueError, naming the field, when `cfg` computes something its HF class cannot: the HF model
    would silently compute another network. Every class ties embeddings or not, and takes any activation."""
    architecture = hf_architecture(cfg)
    family = dataclasses.asdict(FAMILY_FEATURES[cfg.family])
    for name, value in dataclasses.asdict(cfg.features).items():
        if name not in _FREE_FEATURES and value != family[name]:
            raise _refuse(name, value, architecture, family[name], cfg.family)
    if cfg.num_experts:
        _check_hf_experts(cfg, architecture)


def _check_hf_experts(cfg: ModelConfig, architecture: str) -> None:
    """Mixtral and Qwen3-MoE route by a softmax over all experts, top-k, renormalised (Qwen3-MoE: optionally),
    unscaled, without groups, a shared expert or a bias in the choice; Mixtral has experts in every layer."""
    fixed = {"moe_router": "softmax", "moe_scaling_factor": 1.0, "moe_shared_expert_size": 0,
             "moe_expert_bias": False}
    if architecture == "MixtralForCausalLM":
        fixed["moe_norm_topk_prob"] = True
    for name, value in fixed.items():
        if getattr(cfg, name) != value:
            raise _refuse(name, getattr(cfg, name), architecture, value, cfg.family)
    groups = cfg.moe_router_groups
    if groups > 1 and (cfg.moe_router_group_topk or groups) < groups:
        raise _refuse("moe_router_group_topk", cfg.moe_router_group_topk, architecture, groups, cfg.family)
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if architecture == "MixtralForCausalLM" and dense:
        raise ValueError(f"layers {dense} have dense MLPs (model.moe_first_dense_layers={cfg.moe_first_dense_layers}"
                         f", model.moe_layer_freq={cfg.moe_layer_freq}), but MixtralForCausalLM (model.family=llama) "
                         "has experts in every layer; this model has no Hugging Face equivalent and cannot be "
                         "converted (model.family=qwen3 maps dense layers, as Qwen3-MoE)")


def _qwen3_moe_layout(cfg: ModelConfig) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) putting Qwen3-MoE's experts in exactly `cfg`'s expert layers: HF
    has experts in every step-th layer (counted from 1) not listed as dense."""
    first, freq = cfg.moe_first_dense_layers, cfg.moe_layer_freq
    step = freq if (first + 1) % freq == 0 else 1
    return step, [i for i in range(cfg.num_layers) if (i + 1) % step == 0 and not cfg.is_moe_layer(i)]


def hf_config(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """The transformers config describing the same network as `cfg` (token ids: its tokenizer's, if any)."""
    import transformers

    architecture = hf_architecture(cfg)
    check_hf_features(cfg)
    tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    activation = HF_ACTIVATIONS[cfg.features.activation][0]
    if cfg.family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.positions, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size, activation_function=activation,
            layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tied, **tokens,
        )
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.positions, rms_norm_eps=cfg.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_dropout=cfg.attention_dropout,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tied, hidden_act=activation, **tokens,
    )
    experts = {"num_experts_per_tok": cfg.moe_topk}
    if architecture == "LlamaForCausalLM":
        return transformers.LlamaConfig(**common, intermediate_size=cfg.ffn_size, attention_bias=False, mlp_bias=False)
    if architecture == "MixtralForCausalLM":
        return transformers.MixtralConfig(**common, **experts, intermediate_size=cfg.expert_ffn_size,
                                          num_local_experts=cfg.num_experts, sliding_window=None,
                                          router_jitter_noise=0.0)
    qwen = dict(common, intermediate_size=cfg.ffn_size, attention_bias=False, use_sliding_window=False)
    if architecture == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**qwen)
    step, dense = _qwen3_moe_layout(cfg)
    return transformers.Qwen3MoeConfig(**qwen, **experts, num_experts=cfg.num_experts,
                                       moe_intermediate_size=cfg.expert_ffn_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                                       decoder_sparse_step=step, mlp_only_layers=dense)


# HF config field -> the values megalite computes (the first is what it writes); anything else changes the network.
_FIXED = {
    "gpt2": {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
             "add_cross_attention": (False,)},
    "llama": {"attention_bias": (False,), "mlp_bias": (False,)},
    "mixtral": {"router_jitter_noise": (0.0,)},
    "qwen3": {"attention_bias": (False,)},
    "qwen3_moe": {"attention_bias": (False,)},
}


def _check_fixed(hf, source: str) -> None:
    for name, allowed in _FIXED[hf.model_type].items():
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
    window shorter than the model's context."""
    types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if types is not None:
        windowed = [i for i, kind in enumerate(types) if kind != "full_attention"]
    else:
        windowed = [] if window is None or window >= hf.max_position_embeddings else list(range(hf.num_hidden_layers))
    if windowed:
        raise ValueError(f"{source}: layers {windowed} attend through a sliding window (sliding_window={window}, "
                         f"layer_types={types}); megalite computes full causal attention only")


def model_config_from_hf(hf, source: str) -> ModelConfig:
    """The megalite ModelConfig of a transformers config of an architecture in ARCHITECTURES (`source` names it in
    errors). seq_length is the model's context (max_position_embeddings); override it for training."""
    if hf.model_type in UNSUPPORTED:
        raise ValueError(f"{source}: model_type={hf.model_type!r} computes {UNSUPPORTED[hf.model_type]}, which "
                         "megalite does not; this model cannot be converted")
    if hf.model_type not in _FIXED:
        raise ValueError(f"{source}: model_type={hf.model_type!r}; megalite converts "
                         + ", ".join(sorted(_FIXED)) + f" ({', '.join(ARCHITECTURES.values())})")
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
    return _rope_model(hf, source, **_experts(hf, source))


def _experts(hf, source: str) -> dict:
    """The ModelConfig fields of a Mixtral's or Qwen3-MoE's routed experts (none for Llama and Qwen3)."""
    if hf.model_type == "mixtral":
        return {"num_experts": hf.num_local_experts, "moe_topk": hf.num_experts_per_tok,
                "moe_ffn_hidden_size": hf.intermediate_size, "moe_norm_topk_prob": True}
    if hf.model_type != "qwen3_moe":
        return {}
    # Qwen3-MoE's expert layers: every decoder_sparse_step-th (counted from 1) but those in mlp_only_layers
    layers = [i for i in range(hf.num_hidden_layers)
              if i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0]
    if not layers:
        return {}  # a dense Qwen3 network
    fields = {"num_experts": hf.num_experts, "moe_topk": hf.num_experts_per_tok,
              "moe_ffn_hidden_size": hf.moe_intermediate_size, "moe_norm_topk_prob": hf.norm_topk_prob,
              "moe_first_dense_layers": layers[0],
              "moe_layer_freq": layers[1] - layers[0] if len(layers) > 1 else hf.num_hidden_layers}
    placed = ModelConfig(num_layers=hf.num_hidden_layers, **fields)
    if [i for i in range(hf.num_hidden_layers) if placed.is_moe_layer(i)] != layers:
        raise ValueError(f"{source}: experts in layers {layers} (decoder_sparse_step={hf.decoder_sparse_step}, "
                         f"mlp_only_layers={hf.mlp_only_layers}); megalite puts experts in every moe_layer_freq-th "
                         "layer after the first moe_first_dense_layers and cannot place them there")
    return fields


def _rope_model(hf, source: str, **experts) -> ModelConfig:
    """A Llama, Mixtral, Qwen3 or Qwen3-MoE config: attention, RoPE, norms, embeddings, then `experts`."""
    rope = hf.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_parameters.rope_type={rope['rope_type']!r}; "
                         "megalite implements plain RoPE (default) only")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(f"{source}: head_dim={head_dim} x num_attention_heads={hf.num_attention_heads} "
                         f"!= hidden_size={hf.hidden_size}; megalite derives head_dim as hidden_size / heads")
    return ModelConfig(
        family="qwen3" if hf.model_type.startswith("qwen3") else "llama", num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads or hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
        seq_length=hf.max_position_embeddings, max_position_embeddings=hf.max_position_embeddings,
        vocab_size=hf.vocab_size, tie_embeddings=hf.tie_word_embeddings,
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm_epsilon=hf.rms_norm_eps,
        init_std=hf.initializer_range, attention_dropout=hf.attention_dropout, activation=_activation(hf, source),
        **experts,
    )
