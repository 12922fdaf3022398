"""megalite's GPT equals Hugging Face's GPT2LMHeadModel / LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
and, with routed experts, MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM on the same weights
(routers spread so that no top-k choice is near a tie, biases away from zero, sinks spread: tests/hf_models.py),
with heads wider than hidden / heads, Llama 3's RoPE scaling, and sliding windows shorter than the sequence
(MistralForCausalLM, Qwen2's on some layers, GptOssForCausalLM's with sinks, YaRN and its clamped experts); YaRN's
tables are transformers' own."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import tiny_config
from hf_models import routing_margin, spread_routers_and_norms

from megalite.checkpoint.hf_config import hf_config
from megalite.checkpoint.hf_mapping import from_hf, to_hf
from megalite.model.gpt import GPTModel

MOE = {"num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 32, "num_query_groups": 2, "num_layers": 3}
# Llama 3's scaling with head_dim 16 and theta 5e5: wavelengths 6.3 (kept: under 64 / 4), 33 (blended) and from
# 168 on (slowed: over 64 / 1) positions, so all three regimes are compared.
LLAMA3 = {"rope_scaling": "llama3", "rope_theta": 5e5, "rope_scaling_factor": 8.0, "rope_original_max_positions": 64,
          "max_position_embeddings": 128}
# gpt-oss's YaRN (no truncation) with the original context at 8 positions: its ramp spans channels 2 to 5 of 8.
GPT_OSS_YARN = {"rope_scaling": "yarn", "rope_theta": 150000.0, "rope_scaling_factor": 32.0,
                "rope_original_max_positions": 8, "rope_truncate": False, "max_position_embeddings": 64}
FAMILIES = {  # name -> (family, model fields, HF class)
    "gpt2": ("gpt2", {}, transformers.GPT2LMHeadModel),
    "gpt2-exact-gelu": ("gpt2", {"activation": "gelu"}, transformers.GPT2LMHeadModel),  # Megatron-LM's GPT MLP
    "llama": ("llama", {"num_query_groups": 2, "rope_theta": 5000.0, "vocab_size": 250},
              transformers.LlamaForCausalLM),
    "llama-tied-mha": ("llama", {"num_query_groups": None, "tie_embeddings": True}, transformers.LlamaForCausalLM),
    "qwen3": ("qwen3", {"num_query_groups": 2, "tie_embeddings": True}, transformers.Qwen3ForCausalLM),
    "qwen3-wide-heads": ("qwen3", {"num_query_groups": 2, "head_dim": 32}, transformers.Qwen3ForCausalLM),
    "qwen2": ("qwen2", {"num_query_groups": 2}, transformers.Qwen2ForCausalLM),
    "llama3-rope-scaling": ("llama", LLAMA3, transformers.LlamaForCausalLM),
    "mixtral": ("llama", {**MOE, "rope_theta": 1e6}, transformers.MixtralForCausalLM),
    "mixtral-gelu-tanh": ("llama", {**MOE, "activation": "gelu_tanh"}, transformers.MixtralForCausalLM),
    "qwen3-moe": ("qwen3", {**MOE, "moe_first_dense_layers": 1, "moe_norm_topk_prob": False},
                  transformers.Qwen3MoeForCausalLM),
    "qwen2-moe": ("qwen2", {**MOE, "moe_first_dense_layers": 1, "moe_shared_expert_size": 48,
                            "moe_shared_expert_gate": True, "head_dim": 8}, transformers.Qwen2MoeForCausalLM),
    # sliding windows of 6 positions, shorter than every sequence compared (17 and 32 tokens)
    "mistral-sliding-window": ("llama", {"num_query_groups": 2, "sliding_window": 6}, transformers.MistralForCausalLM),
    "qwen2-window-layers": ("qwen2", {"num_query_groups": 2, "sliding_window": 6, "sliding_window_layers": [1]},
                            transformers.Qwen2ForCausalLM),
    "gpt-oss": ("gpt_oss", {**MOE, "sliding_window": 6, "sliding_window_layers": [0, 2], **GPT_OSS_YARN},
                transformers.GptOssForCausalLM),
}


def _pair(name: str):
    """megalite's and HF's model of FAMILIES[name], each drawn from a fixed seed, as are the tokens each test draws
    next: every run compares the same weights on the same tokens. (Drawn from torch's per-process seed instead,
    one run in about a hundred put some token's k-th and (k+1)-th expert within 1e-4 of a tie.)"""
    torch.manual_seed(0)
    family, overrides, hf_class = FAMILIES[name]
    cfg = tiny_config(family, model=overrides)
    model = GPTModel(cfg.model, torch.device("cpu"), seed=cfg.train.seed).eval()
    hf = hf_class(hf_config(cfg.model)).eval()
    spread_routers_and_norms(model)
    spread_routers_and_norms(hf, seed=1)
    return cfg, model, hf


def _assert_same_logits(name: str, model: GPTModel, hf, tokens: torch.Tensor) -> None:
    """Equal logits, at choices of experts far from ties (when the model has experts)."""
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    print(f"{name}: max |logits difference| {(ours - theirs).abs().max().item():.2e} "
          f"(logits up to {theirs.abs().max().item():.2f})")
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    if model.cfg.num_experts:
        assert routing_margin(model, tokens) > 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_megalite_weights_in_hf_give_same_logits(name):
    cfg, model, hf = _pair(name)
    result = hf.load_state_dict(to_hf(model.state_dict(), cfg.model), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    _assert_same_logits(name, model, hf, torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length)))


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_weights_in_megalite_give_same_logits(name):
    cfg, model, hf = _pair(name)
    model.load_state_dict(from_hf(hf.state_dict(), cfg.model))
    _assert_same_logits(name, model, hf, torch.randint(0, cfg.model.vocab_size, (3, 17)))


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_exact(name):
    cfg, model, _ = _pair(name)
    state = model.state_dict()
    back = from_hf(to_hf(state, cfg.model), cfg.model)
    vocab = cfg.model.vocab_size
    for key, value in state.items():
        rows = slice(0, vocab) if key in ("embedding.word_embeddings.weight", "lm_head.weight") else slice(None)
        assert torch.equal(back[key][rows], value[rows]), key


def test_loss_ignores_vocab_padding():
    """Padded vocabulary rows never take probability mass: changing them changes nothing."""
    cfg = tiny_config(model={"vocab_size": 250})
    model = GPTModel(cfg.model, torch.device("cpu"), seed=cfg.train.seed)
    tokens = torch.randint(0, 250, (2, 16))
    before = model(tokens, tokens)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[250:] = 100.0
    torch.testing.assert_close(model(tokens, tokens), before, atol=0, rtol=0)
    assert cfg.model.padded_vocab_size == 256


@pytest.mark.parametrize("family, feature, value, message", [
    ("llama", "bias", True, "model.bias=true, but LlamaForCausalLM \\(model.family=llama\\) computes bias=false"),
    ("gpt2", "position_embedding", "rope", "model.position_embedding=rope, but GPT2LMHeadModel"),
    ("llama", "qk_norm", True, "model.qk_norm=true, but LlamaForCausalLM \\(model.family=llama\\) computes "
                               "qk_norm=false"),
    ("qwen3", "qk_norm", False, "model.qk_norm=false, but Qwen3ForCausalLM"),
    ("qwen2", "qkv_bias", False, "model.qkv_bias=false, but Qwen2ForCausalLM"),
])
def test_a_model_whose_features_differ_from_its_family_is_not_converted(family, feature, value, message):
    cfg = tiny_config(family, model={feature: value})
    state = GPTModel(cfg.model, torch.device("cpu"), seed=cfg.train.seed).state_dict()
    for convert in (lambda: hf_config(cfg.model), lambda: to_hf(state, cfg.model)):
        with pytest.raises(ValueError, match=message):
            convert()


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "qwen3-moe", "llama3-rope-scaling", "qwen2-moe"])
def test_position_ids_match_hf(name):
    cfg, model, hf = _pair(name)
    hf.load_state_dict(to_hf(model.state_dict(), cfg.model), strict=False)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, position_ids=positions), hf(tokens, position_ids=positions).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("mscale", [None, (1.0, 0.707), (0.707, 0.707)])
def test_yarn_frequencies_and_scale_are_transformers_own(truncate, mscale):
    """YaRN's inverse frequencies bit for bit and its cos/sin scale (0.1 ln(factor) + 1, or the mscale ratio) as
    transformers computes them, with the ramp's bounds truncated or not (gpt-oss: not)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megalite.config import ModelConfig
    from megalite.model.rope import inverse_frequencies, yarn_magnitude

    extra = {"mscale": mscale[0], "mscale_all_dim": mscale[1]} if mscale else {}
    hf = transformers.GptOssConfig(
        hidden_size=64, head_dim=64, num_attention_heads=4, max_position_embeddings=512 * 32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 512, **extra})
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    mscales = {"rope_mscale": mscale[0], "rope_mscale_all_dim": mscale[1]} if mscale else {}
    cfg = ModelConfig(family="gpt_oss", hidden_size=64, head_dim=64, num_attention_heads=4, rope_theta=150000.0,
                      rope_scaling="yarn", rope_scaling_factor=32.0, rope_original_max_positions=512,
                      rope_truncate=truncate, **mscales)
    assert torch.equal(inverse_frequencies(cfg, torch.device("cpu")), inv_freq)
    assert yarn_magnitude(cfg) == scale
