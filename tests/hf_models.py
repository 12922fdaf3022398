"""Tiny random transformers models of the mixture-of-experts and q/k-norm architectures, built from configs
here (no hub): Mixtral, dense Qwen3, Qwen3-MoE with a dense first layer and unnormalised top-k weights; and
of every family megalite converts, with the features their released models have (FAMILIES).

Their routers are redrawn with std 0.3 so that the router logits of a token (std about 2.5) lie far apart:
the k-th and (k+1)-th best experts then differ by much more than fp32 round-off (`routing_margin` says by how
much), and both codebases choose the same experts (HF initialises Qwen3-MoE's router to zeros: every choice
would be a tie), while the softmax is not so peaked that unnormalised top-k weights already sum to 1. Norm
weights are drawn around 1 and biases around 0 (both codebases start them at 1 and 0), so a norm or a bias
mapped to the wrong tensor shows in the logits.
"""

from __future__ import annotations

import tokenizers
import torch
import transformers
from released_configs import RELEASED, released_config

from megalite.model.gpt import GPTModel
from megalite.model.moe.router import Router

TINY = {"vocab_size": 250, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}

MODELS = {  # name -> (config class, its fields beyond TINY)
    "mixtral": (transformers.MixtralConfig, {"intermediate_size": 32, "num_local_experts": 4,
                                             "num_experts_per_tok": 2}),
    "qwen3": (transformers.Qwen3Config, {"intermediate_size": 96, "tie_word_embeddings": True}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"intermediate_size": 96, "moe_intermediate_size": 32,
                                                "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                                                "norm_topk_prob": False}),
}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# The released families' features in miniature, 4 layers (two pipeline stages): Qwen2's q/k/v biases, Qwen2-MoE's
# gated shared expert, Qwen3's heads wider than hidden / heads, Llama 3's RoPE scaling (wavelengths kept, blended
# and slowed: see test_hf_parity.py's LLAMA3), Mistral (v0.3's full attention, v0.1's sliding window: here 6
# positions), gpt-oss (sinks, windows of 6 on the even layers, YaRN without truncation over an original context of
# 16, biased router and clamped experts), and GPT-2 with exact GELU (Megatron-LM's).
LAYERS4 = {**TINY, "num_hidden_layers": 4, "intermediate_size": 96}
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16}
FAMILIES = {  # name -> (HF config, the class megalite exports it as)
    "qwen2": (transformers.Qwen2Config(**LAYERS4), "Qwen2ForCausalLM"),
    "qwen2_moe": (transformers.Qwen2MoeConfig(**LAYERS4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                              num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]),
                  "Qwen2MoeForCausalLM"),
    "qwen3_wide_heads": (transformers.Qwen3Config(**{**LAYERS4, "head_dim": 32}, tie_word_embeddings=True),
                         "Qwen3ForCausalLM"),
    "llama3_rope_scaling": (transformers.LlamaConfig(**{**LAYERS4, "max_position_embeddings": 128}, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "LlamaForCausalLM"),
    "mistral": (transformers.MistralConfig(**LAYERS4, sliding_window=None), "LlamaForCausalLM"),
    "mistral_window": (transformers.MistralConfig(**LAYERS4, sliding_window=6), "MistralForCausalLM"),
    "gpt_oss": (transformers.GptOssConfig(**{**LAYERS4, "intermediate_size": 32}, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=6, rope_parameters=GPT_OSS_YARN),
                "GptOssForCausalLM"),
    "gpt2_exact_gelu": (transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=250, n_positions=64,
                                                activation_function="gelu", bos_token_id=249, eos_token_id=249),
                        "GPT2LMHeadModel"),
}

# A released model (tests/released_configs.py) in miniature: its config.json with this shape and everything else as
# released (RoPE theta and Llama 3.1's scaling, Qwen3's 128-wide heads and q/k norms, untied embeddings, the norm's
# epsilon); chat_tokenizer's vocabulary and end-of-text id; weights drawn with std 0.1 (not 0.02), so that the
# logits and the attention depend on them. Llama 3.1's original context (8192) becomes 32 positions, so that its
# scaling changes how a short sample is seen.
TINY_RELEASED = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 96, "vocab_size": 250, "initializer_range": 0.1, "bos_token_id": None,
                 "eos_token_id": 248}


def tiny_released(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """The random fp32 miniature (TINY_RELEASED) of released model `name`, in eval mode."""
    rope_scaling = RELEASED[name][0].get("rope_scaling")
    changes = {"rope_scaling": {**rope_scaling, "original_max_position_embeddings": 32}} if rope_scaling else {}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(released_config(name, **TINY_RELEASED, **changes)).eval()
    spread_routers_and_norms(model, seed)
    return model


@torch.no_grad()
def spread_routers_and_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw router weights (HF `mlp.gate.weight`, megalite and gpt-oss `mlp.router.weight`) with std 0.3, norm
    weights uniformly in [0.5, 1.5), biases with std 0.1 and attention sinks with std 1, in place."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        elif "norm" in name:
            param.copy_(0.5 + torch.rand(param.shape, generator=generator))
        elif name.endswith("bias"):
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
        elif name.endswith("sinks"):
            param.copy_(torch.randn(param.shape, generator=generator))


def random_hf(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """The tiny random fp32 model `name` (a key of MODELS or FAMILIES), in eval mode."""
    if name in MODELS:
        config_class, fields = MODELS[name]
        config = config_class(**TINY, **fields)
    else:
        config = FAMILIES[name][0]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    spread_routers_and_norms(model, seed)
    return model


def chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over FAMILIES' 250 ids (w0..w245 and four special tokens) with a chat template, as
    instruction-tuned models ship one."""
    vocab = {f"w{i}": i for i in range(246)} | {"<unk>": 246, "<|im_start|>": 247, "<|im_end|>": 248,
                                                "<|endoftext|>": 249}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=template)


@torch.no_grad()
def routing_margin(model: GPTModel, tokens: torch.Tensor) -> float:
    """The smallest gap, over the tokens and expert layers of a forward of `tokens`, between the router logits of
    a token's k-th and (k+1)-th best experts (the gap of the log-softmax scores): a choice could flip between
    two implementations only where it nears fp32 round-off."""
    gaps = []

    def record(router: Router, args: tuple, routing) -> None:
        best = routing.scores.log().topk(router.cfg.moe_topk + 1, dim=-1).values
        gaps.append((best[:, -2] - best[:, -1]).min().item())

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, Router)]
    try:
        model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return min(gaps)
