"""The Hugging Face architecture of a megalite model, and its config (megalite -> HF; hf_config_read.py reads).

The family and whether the model has routed experts pick the transformers class: gpt2 is GPT2LMHeadModel,
llama is LlamaForCausalLM (MistralForCausalLM with a sliding window, MixtralForCausalLM with experts), qwen2 is
Qwen2ForCausalLM (Qwen2MoeForCausalLM with experts), qwen3 is Qwen3ForCausalLM (Qwen3MoeForCausalLM with
experts), gpt_oss (with experts) is GptOssForCausalLM; a model with latent attention is DeepseekV3ForCausalLM
(hf_deepseek.py). A config only maps when both sides compute the same
network: a megalite model whose features or expert routing its HF class cannot express (a Llama with biases, a
sigmoid router, a shared expert outside Qwen2-MoE, a Mixtral with dense layers, a window on some of Mistral's
layers) is refused with the reason, naming the field. Nothing is ever converted into a different network.

What every class expresses either way: tied or untied embeddings, the activation (GELU exact or tanh, SiLU,
quick GELU; gpt-oss's as its swiglu_alpha), the head width (head_dim; GPT-2's heads split the width), RoPE's
theta, Llama 3's and YaRN's frequency scaling; sliding windows on every layer (Mistral, Mixtral, Qwen3-MoE) or
on any of them (Qwen2, Qwen3, Qwen2-MoE and gpt-oss, by layer_types).
"""

from __future__ import annotations

import dataclasses

from megalite.checkpoint import hf_deepseek
from megalite.config import FAMILY_FEATURES, ModelConfig

# (family, has experts) -> the transformers class computing that network (a windowed dense llama: WINDOWED_LLAMA).
ARCHITECTURES = {
    ("gpt2", False): "GPT2LMHeadModel", ("llama", False): "LlamaForCausalLM", ("llama", True): "MixtralForCausalLM",
    ("qwen2", False): "Qwen2ForCausalLM", ("qwen2", True): "Qwen2MoeForCausalLM",
    ("qwen3", False): "Qwen3ForCausalLM", ("qwen3", True): "Qwen3MoeForCausalLM",
    ("gpt_oss", True): "GptOssForCausalLM",
}
WINDOWED_LLAMA = "MistralForCausalLM"  # the Llama architecture with a sliding window in every layer

# megalite's model.activation -> its names in HF's activation_function (GPT-2) / hidden_act (the others); the first
# is what megalite writes. HF's gelu_new computes the tanh approximation in separate ops: equal to round-off.
HF_ACTIVATIONS = {"gelu_tanh": ("gelu_new", "gelu_pytorch_tanh"), "gelu": ("gelu",), "silu": ("silu", "swish"),
                  "quick_gelu": ("quick_gelu",)}
# gpt-oss's experts apply gate * sigmoid(swiglu_alpha * gate): megalite's activation of each alpha.
SWIGLU_ALPHAS = {"silu": 1.0, "quick_gelu": 1.702}

# Features every HF class expresses both ways; the others must be the family's (gpt-oss's clamp is its config's).
_FREE_FEATURES = ("tie_embeddings", "activation")
_FREE_GPT_OSS = ("glu_limit",)
# Classes whose sliding window, when set, covers every layer (the others take layer_types).
_EVERY_LAYER_WINDOW = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers class name of `cfg`'s network; ValueError when there is none."""
    key = (cfg.family, cfg.num_experts > 0)
    if cfg.multi_latent_attention and cfg.family == "llama":
        return hf_deepseek.ARCHITECTURE
    if key not in ARCHITECTURES:
        raise ValueError(f"model.family={cfg.family} with model.num_experts={cfg.num_experts} has no Hugging Face "
                         "architecture megalite maps (experts map for llama: Mixtral, qwen2: Qwen2-MoE and qwen3: "
                         "Qwen3-MoE; gpt_oss maps with experts only); this model cannot be converted")
    if key == ("llama", False) and cfg.sliding_window is not None:
        return WINDOWED_LLAMA
    return ARCHITECTURES[key]


def _refuse(field: str, value: object, architecture: str, computes: object, family: str) -> ValueError:
    return ValueError(f"model.{field}={str(value).lower()}, but {architecture} (model.family={family}) computes "
                      f"{field}={str(computes).lower()}; this model has no Hugging Face equivalent and cannot be "
                      "converted")


def check_hf_features(cfg: ModelConfig) -> None:
    """Raise ValueError, naming the field, when `cfg` computes something its HF class cannot: the HF model
    would silently compute another network."""
    architecture = hf_architecture(cfg)
    family = dataclasses.asdict(FAMILY_FEATURES[cfg.family])
    free = _FREE_FEATURES + (_FREE_GPT_OSS if cfg.family == "gpt_oss" else ())
    for name, value in dataclasses.asdict(cfg.features).items():
        if name not in free and value != family[name]:
            raise _refuse(name, value, architecture, family[name], cfg.family)
    if cfg.family == "gpt_oss" and cfg.features.activation not in SWIGLU_ALPHAS:
        raise _refuse("activation", cfg.features.activation, architecture, " or ".join(SWIGLU_ALPHAS), cfg.family)
    windowed = [i for i in range(cfg.num_layers) if cfg.window(i) is not None]
    if architecture in _EVERY_LAYER_WINDOW and windowed and len(windowed) < cfg.num_layers:
        raise ValueError(f"model.sliding_window_layers={cfg.sliding_window_layers}, but {architecture} "
                         f"(model.family={cfg.family}) has its sliding window in every layer; this model has no "
                         "Hugging Face equivalent and cannot be converted")
    if architecture == "GPT2LMHeadModel" and cfg.head_size * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"model.head_dim={cfg.head_dim} x num_attention_heads={cfg.num_attention_heads} != "
                         f"hidden_size={cfg.hidden_size}, but GPT2LMHeadModel's heads split the width; this model "
                         "has no Hugging Face equivalent and cannot be converted")
    if cfg.mtp_num_layers and architecture != hf_deepseek.ARCHITECTURE:
        raise ValueError(f"model.mtp_num_layers={cfg.mtp_num_layers}, but {architecture} has no multi-token "
                         f"prediction layers ({hf_deepseek.ARCHITECTURE} alone stores them); convert with --drop-mtp "
                         "(megalite_to_hf(..., drop_mtp=True)) to write the main model without its MTP weights")
    if architecture == hf_deepseek.ARCHITECTURE:
        hf_deepseek.check_deepseek(cfg)
    elif cfg.num_experts:
        _check_hf_experts(cfg, architecture)


def _check_hf_experts(cfg: ModelConfig, architecture: str) -> None:
    """Mixtral, Qwen2-MoE and Qwen3-MoE route by a softmax over all experts, top-k, renormalised (Mixtral: always),
    unscaled, without groups or a bias in the choice; Qwen2-MoE adds a sigmoid-gated shared expert, the others
    have none; Mixtral has experts in every layer."""
    fixed = {"moe_router": "softmax", "moe_scaling_factor": 1.0, "moe_expert_bias": False}
    if architecture == "Qwen2MoeForCausalLM":
        fixed["moe_shared_expert_gate"] = True
        if not cfg.moe_shared_expert_size:
            raise ValueError("model.moe_shared_expert_size=0, but Qwen2MoeForCausalLM (model.family=qwen2) has a "
                             "gated shared expert in every expert layer; set model.moe_shared_expert_size and "
                             "model.moe_shared_expert_gate=true, or this model cannot be converted")
    else:
        fixed["moe_shared_expert_size"] = 0
    if architecture in ("MixtralForCausalLM", "GptOssForCausalLM"):
        fixed["moe_norm_topk_prob"] = True
    for name, value in fixed.items():
        if getattr(cfg, name) != value:
            raise _refuse(name, getattr(cfg, name), architecture, value, cfg.family)
    groups = cfg.moe_router_groups
    if groups > 1 and (cfg.moe_router_group_topk or groups) < groups:
        raise _refuse("moe_router_group_topk", cfg.moe_router_group_topk, architecture, groups, cfg.family)
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    if architecture in ("MixtralForCausalLM", "GptOssForCausalLM") and dense:
        raise ValueError(f"layers {dense} have dense MLPs (model.moe_first_dense_layers={cfg.moe_first_dense_layers}"
                         f", model.moe_layer_freq={cfg.moe_layer_freq}), but {architecture} (model.family="
                         f"{cfg.family}) has experts in every layer; this model has no Hugging Face equivalent and "
                         "cannot be converted (model.family=qwen3 maps dense layers, as Qwen3-MoE)")


def _sparse_step_layout(cfg: ModelConfig) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) putting Qwen2-MoE's or Qwen3-MoE's experts in exactly `cfg`'s expert
    layers: HF has experts in every step-th layer (counted from 1) not listed as dense."""
    first, freq = cfg.moe_first_dense_layers, cfg.moe_layer_freq
    step = freq if (first + 1) % freq == 0 else 1
    return step, [i for i in range(cfg.num_layers) if (i + 1) % step == 0 and i not in cfg.moe_layers]


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    """HF's rope_parameters: theta, and with model.rope_scaling=llama3 or yarn their frequency scaling."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope |= {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                 "high_freq_factor": cfg.rope_high_freq_factor,
                 "original_max_position_embeddings": cfg.rope_original_positions}
    if cfg.rope_scaling == "yarn":
        rope |= {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.rope_beta_fast,
                 "beta_slow": cfg.rope_beta_slow, "truncate": cfg.rope_truncate,
                 "original_max_position_embeddings": cfg.rope_original_positions}
        scales = cfg.rope_mscale or cfg.rope_mscale_all_dim
        rope |= {"mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim} if scales else {}
    return rope


def hf_windows(cfg: ModelConfig, architecture: str) -> dict:
    """HF's sliding_window and, where the class takes them, layer_types (and Qwen's use_sliding_window)."""
    if architecture in _EVERY_LAYER_WINDOW or architecture == "LlamaForCausalLM":
        return {"sliding_window": cfg.sliding_window} if architecture != "LlamaForCausalLM" else {}
    types = ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)]
    fields = {"layer_types": types, "sliding_window": cfg.sliding_window}
    return fields if architecture == "GptOssForCausalLM" else fields | {"use_sliding_window": bool(cfg.sliding_window)}


def hf_config(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """The transformers config describing the same network as `cfg` (token ids: its tokenizer's, if any)."""
    import transformers

    architecture = hf_architecture(cfg)
    check_hf_features(cfg)
    tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if cfg.family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab, n_positions=cfg.positions, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size,
            activation_function=HF_ACTIVATIONS[cfg.features.activation][0], layer_norm_epsilon=cfg.norm_epsilon,
            resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
            initializer_range=cfg.init_std, tie_word_embeddings=cfg.tied, **tokens,
        )
    common = dict(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
        max_position_embeddings=cfg.positions, rms_norm_eps=cfg.norm_epsilon, rope_parameters=hf_rope_parameters(cfg),
        attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tied,
        **hf_windows(cfg, architecture), **tokens,
    )
    if architecture == "GptOssForCausalLM":
        return transformers.GptOssConfig(
            **common, intermediate_size=cfg.expert_ffn_size, num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.moe_topk, swiglu_alpha=SWIGLU_ALPHAS[cfg.features.activation],
            swiglu_limit=cfg.features.glu_limit, attention_bias=True)
    common["hidden_act"] = HF_ACTIVATIONS[cfg.features.activation][0]
    if architecture == hf_deepseek.ARCHITECTURE:
        return hf_deepseek.deepseek_hf_config(cfg, common)
    return _rope_family_config(cfg, architecture, common)


def _rope_family_config(cfg: ModelConfig, architecture: str, common: dict):
    """The config of a Llama, Mistral, Mixtral, Qwen2(-MoE) or Qwen3(-MoE) from the fields they share."""
    import transformers

    experts = {"num_experts_per_tok": cfg.moe_topk}
    if architecture == "LlamaForCausalLM":
        return transformers.LlamaConfig(**common, intermediate_size=cfg.ffn_size, attention_bias=False, mlp_bias=False)
    if architecture == WINDOWED_LLAMA:
        return transformers.MistralConfig(**common, intermediate_size=cfg.ffn_size)
    if architecture == "MixtralForCausalLM":
        return transformers.MixtralConfig(**common, **experts, intermediate_size=cfg.expert_ffn_size,
                                          num_local_experts=cfg.num_experts, router_jitter_noise=0.0)
    qwen = dict(common, intermediate_size=cfg.ffn_size)
    if architecture == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(**qwen)
    if architecture == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**qwen, attention_bias=False)
    step, dense = _sparse_step_layout(cfg)
    moe = dict(qwen, **experts, num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_ffn_size,
               norm_topk_prob=cfg.moe_norm_topk_prob, decoder_sparse_step=step, mlp_only_layers=dense)
    if architecture == "Qwen2MoeForCausalLM":
        return transformers.Qwen2MoeConfig(**moe, shared_expert_intermediate_size=cfg.moe_shared_expert_size,
                                           qkv_bias=True)
    return transformers.Qwen3MoeConfig(**moe, attention_bias=False,
                                       use_sliding_window=cfg.sliding_window is not None)
