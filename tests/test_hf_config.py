"""Configs both ways between megalite and transformers (megalite/checkpoint/hf_config.py): the family and the
experts pick the HF class, a config survives megalite -> HF -> megalite, Qwen3-MoE's expert layers land where
megalite puts them, and every network one side computes but the other does not is refused with its reason."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import tiny_config
from hf_models import TINY
from released_configs import RELEASED, released_config

from megalite.checkpoint.hf_config import hf_config
from megalite.checkpoint.hf_config_read import model_config_from_hf
from megalite.checkpoint.hf_mapping import to_hf
from megalite.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.planning.parameters import model_parameters, vocabulary_padding

MOE = {"num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 32}


def network(m: ModelConfig) -> tuple:
    """What determines the function a model computes, routed experts (and a shared one) included."""
    experts = list(m.moe_layers)
    moe = (m.num_experts, m.moe_topk, m.expert_ffn_size, m.moe_norm_topk_prob, experts, m.moe_shared_expert_size,
           m.moe_shared_expert_gate) if experts else ()
    dense_ffn = m.ffn_size if len(experts) < m.num_layers else None
    rope = (m.rope_theta, m.rope_scaling) if m.features.position_embedding == "rope" else None
    if rope and m.rope_scaling == "llama3":
        rope += (m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_positions)
    if rope and m.rope_scaling == "yarn":
        rope += (m.rope_factor, m.rope_original_positions, m.rope_beta_fast, m.rope_beta_slow, m.rope_mscale,
                 m.rope_mscale_all_dim, m.rope_truncate)
    windows = [m.window(i) for i in range(m.num_layers)]
    return (m.family, m.features, m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_size,
            dense_ffn, m.positions, m.vocab_size, rope, m.norm_epsilon, moe, windows)


SHARED = {**MOE, "moe_shared_expert_size": 48, "moe_shared_expert_gate": True}
LLAMA3 = {"rope_scaling": "llama3", "rope_scaling_factor": 32.0, "rope_low_freq_factor": 2.0,
          "rope_high_freq_factor": 8.0, "rope_original_max_positions": 16}
YARN = {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_positions": 16, "rope_beta_fast": 16.0,
        "rope_beta_slow": 2.0, "rope_truncate": False}


@pytest.mark.parametrize("family, experts, architecture", [
    ("gpt2", {}, "GPT2LMHeadModel"), ("gpt2", {"activation": "gelu"}, "GPT2LMHeadModel"),
    ("llama", {"activation": "gelu_tanh"}, "LlamaForCausalLM"), ("llama", {}, "LlamaForCausalLM"),
    ("llama", MOE, "MixtralForCausalLM"),
    ("qwen3", {}, "Qwen3ForCausalLM"), ("qwen3", MOE, "Qwen3MoeForCausalLM"),
    ("qwen3", {**MOE, "moe_layer_freq": 2, "moe_norm_topk_prob": False}, "Qwen3MoeForCausalLM"),
    ("qwen2", {}, "Qwen2ForCausalLM"), ("qwen2", SHARED, "Qwen2MoeForCausalLM"),
    ("qwen2", {**SHARED, "moe_first_dense_layers": 1, "moe_norm_topk_prob": False}, "Qwen2MoeForCausalLM"),
    ("qwen3", {"head_dim": 32}, "Qwen3ForCausalLM"), ("qwen3", {**MOE, "head_dim": 8}, "Qwen3MoeForCausalLM"),
    ("llama", {"head_dim": 24, **LLAMA3}, "LlamaForCausalLM"), ("qwen2", LLAMA3, "Qwen2ForCausalLM"),
    ("llama", {"sliding_window": 8}, "MistralForCausalLM"),
    ("llama", {**MOE, "sliding_window": 8}, "MixtralForCausalLM"),
    ("qwen2", {"sliding_window": 8, "sliding_window_layers": [1, 3]}, "Qwen2ForCausalLM"),
    ("qwen3", {"sliding_window": 8, "sliding_window_layers": [2, 3], **YARN}, "Qwen3ForCausalLM"),
    ("qwen3", {**MOE, "sliding_window": 8}, "Qwen3MoeForCausalLM"),
    ("qwen2", {**SHARED, "sliding_window": 8, "sliding_window_layers": [0, 2]}, "Qwen2MoeForCausalLM"),
    ("gpt_oss", {**MOE, "sliding_window": 8, "sliding_window_layers": [0, 2], **YARN}, "GptOssForCausalLM"),
    ("gpt_oss", {**MOE, "activation": "silu", "glu_limit": 5.0, "tie_embeddings": True}, "GptOssForCausalLM"),
    ("llama", {**YARN, "rope_mscale": 1.0, "rope_mscale_all_dim": 0.5}, "LlamaForCausalLM"),
])
def test_a_config_survives_megalite_to_hf_and_back(family, experts, architecture):
    cfg = tiny_config(family, model={"num_layers": 4, "rope_theta": 5e5, "norm_epsilon": 1e-6, **experts}).model
    hf = hf_config(cfg)
    assert transformers.AutoModelForCausalLM.from_config(hf).__class__.__name__ == architecture
    assert network(model_config_from_hf(hf, "test")) == network(cfg)


@pytest.mark.parametrize("layers, first_dense, freq", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (6, 2, 3), (5, 0, 2),
                                                       (4, 3, 1), (6, 1, 4)])
def test_qwen3_moe_has_experts_in_megalites_expert_layers(layers, first_dense, freq):
    """Qwen3-MoE's decoder_sparse_step counts layers from 1 and mlp_only_layers lists dense ones; megalite's
    moe_layer_freq counts from after moe_first_dense_layers: the same layers either way."""
    cfg = tiny_config("qwen3", model={**MOE, "num_layers": layers, "moe_first_dense_layers": first_dense,
                                      "moe_layer_freq": freq}).model
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_config(cfg))
    ours = list(cfg.moe_layers)
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == ours
    back = model_config_from_hf(hf.config, "test")
    assert list(back.moe_layers) == ours


def test_a_sliding_window_covering_the_whole_context_is_full_attention():
    cfg = model_config_from_hf(_hf(transformers.MixtralConfig, sliding_window=TINY["max_position_embeddings"]), "t")
    assert cfg.family == "llama" and cfg.num_experts == 8 and cfg.positions == TINY["max_position_embeddings"]


def _hf(config_class, **fields):
    return config_class(**{**TINY, **fields})


@pytest.mark.parametrize("config, window, layers", [
    (_hf(transformers.MistralConfig, sliding_window=32), 32, None),  # Mistral-7B-v0.1: 4096 of 32768 positions
    (_hf(transformers.MixtralConfig, sliding_window=16), 16, None),
    (_hf(transformers.Qwen3Config, use_sliding_window=True, sliding_window=16, max_window_layers=1), 16, [1, 2]),
    (_hf(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=2), 16, [2]),
    (_hf(transformers.Qwen2Config, use_sliding_window=False, sliding_window=16, max_window_layers=2), None, None),
    (_hf(transformers.Qwen2MoeConfig, use_sliding_window=True, sliding_window=16, max_window_layers=2), 16, [0]),
    (_hf(transformers.GptOssConfig, sliding_window=16), 16, [0, 2]),
], ids=lambda x: x.model_type if hasattr(x, "model_type") else None)
def test_hf_sliding_windows_come_in_on_their_layers(config, window, layers):
    """HF's rule (a query sees q - k < sliding_window) on the layers each class puts it: every layer (Mistral,
    Mixtral), layer_types (Qwen's from max_window_layers, gpt-oss's even layers)."""
    cfg = model_config_from_hf(config, "t")
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (window, layers)
    assert network(model_config_from_hf(hf_config(cfg), "t")) == network(cfg)


def test_mistral_is_llama():
    """Mistral is the Llama architecture (with a sliding window, here none): it comes in as megalite's llama, which
    goes out as Llama, computing the same network."""
    cfg = model_config_from_hf(_hf(transformers.MistralConfig, sliding_window=None, head_dim=32), "t")
    assert cfg.family == "llama" and cfg.head_size == 32 and cfg.kv_heads == 2
    assert type(hf_config(cfg)).__name__ == "LlamaConfig"
    assert network(model_config_from_hf(hf_config(cfg), "t")) == network(cfg)


@pytest.mark.parametrize("name", RELEASED)
def test_released_configs_convert_both_ways_at_their_published_size(name):
    """Released config.json files: Qwen3's heads 128 wide whatever the width, Llama-3.2's RoPE scaling (rope_scaling
    in the file), Qwen2.5's q/k/v biases, Mistral, Qwen1.5-MoE's gated shared expert, and Llama-3.1-8B and Qwen3-8B,
    which the continued-pretraining examples start from. megalite builds each at the model card's parameter count
    (its planner counting the same), and writes an HF config building as many."""
    published = RELEASED[name][1]
    cfg = model_config_from_hf(released_config(name), name)
    built = sum(p.numel() for p in GPTModel(cfg, torch.device("meta"), seed=0).parameters())
    assert built == model_parameters(cfg)
    assert built - vocabulary_padding(cfg) == published
    with torch.device("meta"):
        back = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    assert sum(p.numel() for p in back.parameters()) == published
    assert network(model_config_from_hf(back.config, name)) == network(cfg)
    if name == "Llama-3.2-1B":
        assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions) == ("llama3", 32.0, 8192)
    if name == "Mistral-7B-v0.1":
        assert (cfg.sliding_window, cfg.sliding_window_layers) == (4096, None)
        assert type(back).__name__ == "MistralForCausalLM"
    if RELEASED[name][0]["model_type"] in ("deepseek_v3", "kimi_k2"):
        assert cfg.multi_latent_attention and cfg.moe_router == "sigmoid" and cfg.moe_shared_expert_size
        assert type(back).__name__ == "DeepseekV3ForCausalLM"
    if name == "DeepSeek-V3":
        assert (cfg.q_lora_rank, cfg.moe_router_groups, cfg.moe_router_group_topk, cfg.moe_router_group_experts,
                cfg.moe_first_dense_layers, cfg.rope_scaling) == (1536, 8, 4, 2, 3, "yarn")
    if name == "Moonlight-16B-A3B":
        assert (cfg.q_lora_rank, cfg.norm_epsilon, cfg.latent_norm_epsilon) == (None, 1e-5, 1e-6)
    if name.startswith("gpt-oss"):
        assert (cfg.sliding_window, cfg.sliding_window_layers) == (128, list(range(0, cfg.num_layers, 2)))
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_positions, cfg.rope_truncate) == (
            "yarn", 32.0, 4096, False)


@pytest.mark.parametrize("config, message", [
    (_hf(transformers.MixtralConfig, router_jitter_noise=0.1),
     "router_jitter_noise=0.1, but megalite's mixtral computes router_jitter_noise=0.0"),
    (_hf(transformers.Qwen3Config, attention_bias=True), "attention_bias=True, but megalite's qwen3 computes"),
    (_hf(transformers.Qwen3MoeConfig, num_hidden_layers=4, mlp_only_layers=[1], num_experts=4),
     r"experts in layers \[0, 2, 3\] \(decoder_sparse_step=1, mlp_only_layers=\[1\]\); megalite puts experts"),
    (_hf(transformers.Qwen2MoeConfig, qkv_bias=False), "qkv_bias=False, but megalite's qwen2_moe computes qkv_bias"),
    (_hf(transformers.LlamaConfig, attention_bias=True), "attention_bias=True, but megalite's llama computes"),
    (_hf(transformers.LlamaConfig, hidden_act="relu"), "hidden_act='relu', but megalite's llama computes hidden_act="),
    (_hf(transformers.LlamaConfig, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0,
                                                    "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
     r"rope_parameters.rope_type='longrope'; megalite implements plain RoPE \(default\), Llama 3's"),
    (_hf(transformers.LlamaConfig, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                    "attention_factor": 1.5, "original_max_position_embeddings": 16}),
     "rope_parameters.attention_factor=1.5; megalite derives YaRN's scale of cos and sin from factor"),
    (_hf(transformers.Qwen2Config, layer_types=["full_attention", "chunked_attention", "full_attention"]),
     r"layer_types has \['chunked_attention'\]; megalite computes full_attention and sliding_attention only"),
    (_hf(transformers.GptOssConfig, swiglu_alpha=2.0), "swiglu_alpha=2.0, but megalite's gpt_oss computes"),
    (_hf(transformers.GptOssConfig, attention_bias=False), "attention_bias=False, but megalite's gpt_oss computes"),
    (_hf(transformers.LlamaConfig, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor=0.5; megalite rotates the whole head"),
    (transformers.AutoConfig.for_model("deepseek_v2"), r"model_type='deepseek_v2' computes DeepSeek-V2's softmax"),
    (transformers.AutoConfig.for_model("olmoe"), "model_type='olmoe' computes a q/k norm over all heads"),
], ids=lambda x: x.model_type if hasattr(x, "model_type") else None)
def test_an_hf_network_megalite_does_not_compute_is_refused(config, message):
    with pytest.raises(ValueError, match=f"^source: {message}"):
        model_config_from_hf(config, "source")


@pytest.mark.parametrize("family, fields, message", [
    ("gpt2", MOE, "model.family=gpt2 with model.num_experts=4 has no Hugging Face architecture"),
    ("llama", {**MOE, "moe_router": "sigmoid"},
     r"model.moe_router=sigmoid, but MixtralForCausalLM \(model.family=llama\) computes moe_router=softmax"),
    ("llama", {**MOE, "moe_norm_topk_prob": False}, "model.moe_norm_topk_prob=false, but MixtralForCausalLM"),
    ("llama", {**MOE, "moe_first_dense_layers": 1},
     r"layers \[0\] have dense MLPs .* but MixtralForCausalLM \(model.family=llama\) has experts in every layer"),
    ("qwen3", {**MOE, "moe_shared_expert_size": 32}, "model.moe_shared_expert_size=32, but Qwen3MoeForCausalLM"),
    ("qwen2", MOE, "model.moe_shared_expert_size=0, but Qwen2MoeForCausalLM .* has a gated shared expert"),
    ("qwen2", {**SHARED, "moe_shared_expert_gate": False}, "model.moe_shared_expert_gate=false, but Qwen2MoeFor"),
    ("qwen2", {"qkv_bias": False}, r"model.qkv_bias=false, but Qwen2ForCausalLM \(model.family=qwen2\) computes "
                                   "qkv_bias=true"),
    ("llama", {"qkv_bias": True}, "model.qkv_bias=true, but LlamaForCausalLM"),
    ("gpt2", {"head_dim": 32}, "model.head_dim=32 x num_attention_heads=4 != hidden_size=64, but GPT2LMHeadModel"),
    ("qwen3", {**MOE, "moe_scaling_factor": 2.5}, "model.moe_scaling_factor=2.5, but Qwen3MoeForCausalLM"),
    ("qwen3", {**MOE, "moe_expert_bias": True}, "model.moe_expert_bias=true, but Qwen3MoeForCausalLM"),
    ("qwen3", {**MOE, "moe_router_groups": 2, "moe_router_group_topk": 1},
     "model.moe_router_group_topk=1, but Qwen3MoeForCausalLM"),
    ("llama", {"sliding_window": 8, "sliding_window_layers": [1]},
     r"model.sliding_window_layers=\[1\], but MistralForCausalLM \(model.family=llama\) has its sliding window in "
     "every layer"),
    ("qwen3", {**MOE, "sliding_window": 8, "sliding_window_layers": [0]}, "but Qwen3MoeForCausalLM"),
    ("gpt_oss", {}, "model.family=gpt_oss with model.num_experts=0 has no Hugging Face architecture"),
    ("gpt_oss", {**MOE, "activation": "gelu"}, r"model.activation=gelu, but GptOssForCausalLM \(model.family="
                                               r"gpt_oss\) computes activation=silu or quick_gelu"),
    ("gpt_oss", {**MOE, "attention_sinks": False}, "model.attention_sinks=false, but GptOssForCausalLM"),
    ("gpt_oss", {**MOE, "moe_first_dense_layers": 1}, r"but GptOssForCausalLM \(model.family=gpt_oss\) has experts"),
])
def test_a_megalite_network_hf_does_not_compute_is_refused(family, fields, message):
    cfg = tiny_config(family, model={"num_layers": 2, **fields}).model
    state = GPTModel(cfg, torch.device("meta"), seed=0).state_dict()
    for convert in (lambda: hf_config(cfg), lambda: to_hf(state, cfg)):
        with pytest.raises(ValueError, match=message):
            convert()
