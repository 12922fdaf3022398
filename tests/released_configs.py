"""The config.json of released models (as their hub repositories hold them, in transformers 4.x's format:
rope_theta and rope_scaling at the top level), for their shapes only: no weights. Each comes with its
parameter count as transformers counts it (the model cards' figure: gpt-oss-20b 20.9B, gpt-oss-120b 116.8B)."""

from __future__ import annotations

import transformers

from megalite.checkpoint.hf_deepseek import kimi_k2_config

RELEASED = {  # name -> (config.json, parameters)
    "Qwen3-0.6B": ({
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936
    }, 596_049_920),
    "Qwen3-8B": ({
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936
    }, 8_190_735_360),
    "Qwen2.5-0.5B": ({
        "model_type": "qwen2", "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
        "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936
    }, 494_032_768),
    "Llama-3.2-1B": ({
        "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
        "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256
    }, 1_235_814_400),
    "Llama-3.1-8B": ({
        "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
        "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256
    }, 8_030_261_248),
    "Mistral-7B-v0.3": ({
        "model_type": "mistral", "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32768
    }, 7_248_023_552),
    "Mistral-7B-v0.1": ({  # its sliding window, 4096 of 32768 positions, in every layer
        "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": 32000
    }, 7_241_732_096),
    "Qwen1.5-MoE-A2.7B": ({
        "model_type": "qwen2_moe", "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
        "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
        "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936
    }, 14_315_784_192),
    "Qwen3-30B-A3B": ({
        "model_type": "qwen3_moe", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936
    }, 30_532_122_624),
}

# OpenAI's gpt-oss (sinks, windows of 128 on the even layers, YaRN without truncation, MXFP4 experts on the hub).
for _name, _layers, _experts, _count in (("gpt-oss-20b", 24, 32, 20_914_757_184),
                                         ("gpt-oss-120b", 36, 128, 116_829_156_672)):
    RELEASED[_name] = ({
        "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (_layers // 2), "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": _layers, "num_key_value_heads": 8,
        "num_local_experts": _experts, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088
    }, _count)


# DeepSeek-V3's architecture (latent attention, sigmoid group-limited routing, shared experts, dense first layers;
# FP8 weights on the hub): DeepSeek-V3 (671B; its 14B multi-token prediction layer aside, as transformers counts),
# Moonlight-16B-A3B (no query compression, rms_norm_eps 1e-5 beside the latents' 1e-6) and Kimi K2 (model_type
# kimi_k2; YaRN with beta_fast = beta_slow = 1). Typed from the hub's config.json files (keys that only name code or
# training settings, such as auto_map, topk_method, scoring_func, aux_loss_alpha, ep_size, left out).
_MLA = {"attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
        "kv_lora_rank": 512, "moe_layer_freq": 1, "norm_topk_prob": True, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False, "use_cache": True}
_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
RELEASED |= {
    "DeepSeek-V3": ({
        "model_type": "deepseek_v3", **_MLA, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
        "hidden_size": 7168, "intermediate_size": 18432, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "quantization_config": _FP8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "topk_group": 4, "vocab_size": 129280
    }, 671_026_404_352),
    "Moonlight-16B-A3B": ({
        "model_type": "deepseek_v3", **_MLA, "bos_token_id": 163584, "eos_token_id": 163585,
        "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264, "max_position_embeddings": 8192,
        "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
        "q_lora_rank": None, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0,
        "routed_scaling_factor": 2.446, "topk_group": 1, "vocab_size": 163840
    }, 15_960_108_544),
    "Kimi-K2-Instruct": ({
        "model_type": "kimi_k2", **_MLA, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
        "hidden_size": 7168, "intermediate_size": 18432, "max_position_embeddings": 131072,
        "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "quantization_config": _FP8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840
    }, 1_026_408_209_408),
}


def released_config(name: str, **changes) -> transformers.PretrainedConfig:
    """transformers' config of released model `name`, as it reads the config.json, with `changes` to its fields
    (Kimi K2's kimi_k2 as megalite reads it without remote code, checkpoint/hf_deepseek.py)."""
    fields = {**RELEASED[name][0], **changes}
    if fields["model_type"] == "kimi_k2":
        return kimi_k2_config(fields)
    return transformers.CONFIG_MAPPING[fields.pop("model_type")].from_dict(fields)
