"""Multi-head latent attention (model/latent_attention.py, config_mla.py, checkpoint/hf_mla.py).

- It equals transformers' DeepseekV3Attention (fp32), with and without query compression, with YaRN (its mscale on
  the softmax scale and on cos/sin) and the released interleaved rotary rows (permuted to halves at conversion).
- Its config is validated with Megatron-LM's names: model.head_dim and what MLA does not build are refused.
- torch.compile'd, it equals eager: output and every gradient.
- Generation through the cache (the compressed latent and the rotary key per token) gives the logits of a full
  forward, and the cache holds kv_lora_rank + qk_pos_emb_head_dim numbers per token.
- In one spawned group of two gloo ranks, a tiny MLA model (query compression, YaRN, v narrower than q/k) trained at
  tp 2, tp 2 with SP, cp 2 ring, cp 2 all-gather and tp 2 with SP under selective recompute (the up-projections,
  the queries' RoPE and the core rerun from the kept latents) and ZB-V over pp 2, and with DeepSeek-V3's
  routing (DEEPSEEK_MOE) at tp 2 with SP and ep 2, equals one device: losses and every gradient (fp32, three
  steps); so does one device's selective recompute.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks
from parity import assert_equals_one_device, on_one_device, train_and_gather
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from megalite.checkpoint.hf_mla import mla_from_hf, mla_to_hf
from megalite.config import Config, ConfigError, ModelConfig
from megalite.config_validation import validate
from megalite.model.gpt import GPTModel
from megalite.model.kv_cache import KVCache
from megalite.model.latent_attention import LatentAttention
from megalite.model.rope import rope_for, rope_tables
from megalite.parallel.context import ParallelContext
from megalite.parallel.topology import Topology
from megalite.training.build import is_logging_rank

MLA = {"multi_latent_attention": True, "num_query_groups": None, "kv_lora_rank": 16, "qk_head_dim": 8,
       "qk_pos_emb_head_dim": 4, "v_head_dim": 6}
YARN = {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_positions": 8, "rope_mscale": 1.0,
        "rope_mscale_all_dim": 0.8}


def _hf_attention(q_lora: int | None, yarn: bool) -> DeepseekV3Attention:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
    config = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                              max_position_embeddings=64, rope_parameters=rope, rope_interleave=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, 0).eval()
    with torch.no_grad():
        for name, param in attention.named_parameters():
            if "layernorm" in name:
                param.normal_(1.0, 0.2)
    return attention


def _model_config(q_lora: int | None, yarn: bool) -> ModelConfig:
    cfg = ModelConfig(family="llama", hidden_size=32, num_attention_heads=4, seq_length=64, q_lora_rank=q_lora,
                      norm_epsilon=1e-6, **MLA)  # transformers' latent norms have DeepSeek's 1e-6, whatever the config
    for name, value in (YARN if yarn else {}).items():
        setattr(cfg, name, value)
    cfg.rope_truncate = True
    return cfg


@pytest.mark.parametrize(("q_lora", "yarn"), [(None, False), (12, True)])
def test_latent_attention_equals_transformers_deepseek_v3_attention(q_lora, yarn):
    hf = _hf_attention(q_lora, yarn)
    cfg = _model_config(q_lora, yarn)
    ours = LatentAttention(cfg, ParallelContext(), torch.device("cpu")).eval()
    hf_state = {f"model.layers.0.self_attn.{k}": v for k, v in hf.state_dict().items()}
    state = mla_from_hf(hf_state, cfg, 0, interleaved=True)
    ours.load_state_dict({k.removeprefix("layers.0.attention."): v for k, v in state.items()})
    assert mla_to_hf(state, cfg, 0).keys() == hf_state.keys()
    assert all(torch.equal(v, hf_state[k]) for k, v in mla_to_hf(state, cfg, 0).items())  # bit for bit back

    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(10).expand(2, -1)
    causal = torch.full((10, 10), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = hf(x, DeepseekV3RotaryEmbedding(hf.config)(x, positions), causal)[0]
        got = ours(x.transpose(0, 1), rope_for(rope_tables(cfg, x.device), 10, None)).transpose(0, 1)
    assert ours.scale == pytest.approx(hf.scaling)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _problems(**model) -> list[str]:
    cfg = tiny_config("llama", model={**MLA, **model})
    try:
        validate(cfg, 1)
    except ConfigError as error:
        return error.problems
    return []


def test_mla_config_is_validated_with_megatron_names():
    assert _problems() == []
    assert any("model.head_dim=16 has no meaning under model.multi_latent_attention" in p and "qk_pos_emb_head_dim"
               in p for p in _problems(head_dim=16))
    assert any("model.num_query_groups is not available" in p for p in _problems(num_query_groups=2))
    assert any("qk_pos_emb_head_dim=3 must be even" in p for p in _problems(qk_pos_emb_head_dim=3))
    assert any("model.q_lora_rank=0 must be >= 1" in p for p in _problems(q_lora_rank=0))
    assert any("model.sliding_window is not available" in p for p in _problems(sliding_window=4))
    cfg = tiny_config("llama", model=MLA)
    assert cfg.model.rope_dim == 4 and cfg.model.num_attention_heads * 8 != cfg.model.hidden_size


def test_generation_caches_the_latent_and_rotary_key_and_equals_a_full_forward():
    cfg = tiny_config("llama", model={**MLA, **YARN, "q_lora_rank": 12}).model
    model = GPTModel(cfg, torch.device("cpu"), seed=3).eval()
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(16)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :7], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 1, 16, 16) and layer.values.shape == (2, 1, 16, 4)  # latent, rotary key


# ------------------------------------------------------------------------------ one group of two ranks

# DeepSeek-V3's routing in miniature: sigmoid scores, groups scored by their two best, the expert bias moving,
# routed_scaling_factor, a shared expert, a dense first layer, the sequence-wise balancing loss.
DEEPSEEK_MOE = {"num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 16, "moe_router": "sigmoid",
                "moe_router_groups": 2, "moe_router_group_topk": 1, "moe_router_group_experts": 2,
                "moe_expert_bias": True, "moe_bias_update_rate": 0.05, "moe_scaling_factor": 2.5,
                "moe_norm_topk_prob": True, "moe_shared_expert_size": 16, "moe_first_dense_layers": 1,
                "moe_seq_aux_loss_coeff": 0.01}
LAYOUTS = [  # (name, with DEEPSEEK_MOE, parallel fields)
    ("tp 2", False, {"tp": 2}),
    ("tp 2, SP", False, {"tp": 2, "sequence_parallel": True}),
    ("cp 2 ring", False, {"cp": 2}),
    ("cp 2 all-gather, selective recompute", False, {"cp": 2, "cp_comm": "allgather", "recompute": "selective"}),
    ("tp 2, SP, selective recompute (the up-projections rerun, their latents gathered again)", False,
     {"tp": 2, "sequence_parallel": True, "recompute": "selective"}),
    ("ZB-V pp 2 (the down-projections' weight gradients deferred to W)", False,
     {"pp": 2, "vp": 2, "pipeline_schedule": "zb-v"}),
    ("DeepSeek-V3-shaped MoE, tp 2, SP", True, {"tp": 2, "sequence_parallel": True}),
    ("DeepSeek-V3-shaped MoE, ep 2", True, {"ep": 2}),
]


def _mla(moe: bool = False, **parallel) -> Config:
    model = {**MLA, **YARN, "q_lora_rank": 12, "num_layers": 4, "vocab_size": 250, **(DEEPSEEK_MOE if moe else {})}
    train = {"micro_batch_size": 1, "global_batch_size": 2, "train_iters": 3,
             "recompute": parallel.pop("recompute", "none")}
    return tiny_config("llama", model=model, train=train, parallel=parallel)


def _two_ranks(rank: int, world_size: int) -> list:
    layouts = []
    for _, moe, parallel in LAYOUTS:
        cfg = _mla(moe, **dict(parallel))
        losses, gradients = train_and_gather(cfg, cpu_topology(rank, world_size, cfg))
        topology = Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel, moe)
        logging = is_logging_rank(cfg, topology)
        layouts.append((losses if logging else None, gradients))
    return layouts


@pytest.fixture(scope="module")
def one_device() -> dict[bool, tuple[list[float], dict[str, torch.Tensor]]]:
    """The one-device runs, without and with DEEPSEEK_MOE."""
    return {moe: on_one_device(_mla(moe)) for moe in (False, True)}


def test_latent_attention_trains_at_every_layout_as_on_one_device(one_device):
    per_rank = run_ranks(2, _two_ranks)
    for index, (name, moe, _) in enumerate(LAYOUTS):
        losses = next(r[index][0] for r in per_rank if r[index][0] is not None)
        assert_equals_one_device(name, losses, per_rank, index, one_device[moe])


def test_selective_recompute_of_the_up_projections_equals_keeping_them(one_device):
    """train.recompute=selective reruns the up-projections, the queries' RoPE and the core from the kept latents
    (Megatron-Core's mla_up_proj with core_attn): the losses and every gradient are those of a run keeping them."""
    cfg = _mla(recompute="selective")
    recomputed = on_one_device(cfg)
    assert_equals_one_device("selective recompute", recomputed[0], [[recomputed]], 0, one_device[False])


def test_compiled_latent_attention_equals_eager():
    """torch.compile'd (inductor on the CPU), forward and every gradient, with query compression and YaRN."""
    cfg = _model_config(12, yarn=True)
    attention = LatentAttention(cfg, ParallelContext(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1 if param.dim() == 1 else 0))  # norms ~1
    x = torch.randn(16, 2, 32, generator=gen)
    rope = rope_for(rope_tables(cfg, x.device), 16, None)
    results = []
    for run in (attention, torch.compile(attention)):
        attention.zero_grad()
        leaf = x.clone().requires_grad_()
        out = run(leaf, rope)
        out.square().sum().backward()
        results.append([out.detach(), leaf.grad] + [p.grad.clone() for p in attention.parameters()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
