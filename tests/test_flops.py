"""Model and hardware FLOPs per token (megalite/training/flops.py), worked out by hand: a mixture-of-experts layer
counts the weights one token multiplies (router, its top-k experts, shared expert and gate), never the experts it
skips; hardware FLOPs add the forward that recompute reruns, checked against the Megatron-LM paper's formulas."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from conftest import tiny_config

from megalite.config import ModelConfig
from megalite.training.flops import (
    hardware_flops_per_token,
    matmul_parameters,
    recomputed_flops_per_token,
    throughput,
    training_flops_per_token,
)
from megalite.training.pretrain import pretrain


def tiny_moe() -> ModelConfig:
    """Llama, 2 layers, hidden 64, 4 heads of 16, 2 KV groups, seq 32, vocab 300; layer 0 a dense SwiGLU MLP 96
    wide, layer 1 8 experts 48 wide (top 2) with a 32-wide shared expert and its gate."""
    return ModelConfig(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=96, seq_length=32, vocab_size=300, num_experts=8, moe_topk=2,
                       moe_ffn_hidden_size=48, moe_shared_expert_size=32, moe_shared_expert_gate=True,
                       moe_first_dense_layers=1)


def test_a_sliding_window_counts_the_pairs_it_keeps():
    """Layer 0 with a window of 3 of 32 positions: sum of min(q + 1, 3) = 93 pairs of the causal 528, so 32 * 93 /
    528 keys a token, counted as the full square counts 528; layer 1 (no window) the square. A window as long as the
    sequence is full attention."""
    full, windowed = tiny_moe(), tiny_moe()
    windowed.sliding_window, windowed.sliding_window_layers = 3, [0]
    keys = Fraction(32 * 93, 528)
    assert training_flops_per_token(full) - training_flops_per_token(windowed) == pytest.approx(
        float(12 * (32 - keys) * 4 * 16))
    windowed.sliding_window = 32
    assert training_flops_per_token(windowed) == training_flops_per_token(full)


def test_active_flops_of_a_tiny_moe_by_hand():
    attention = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64)  # QKV 8192 + projection 4096, two layers: 24576
    dense_mlp = 3 * 64 * 96  # 18432
    moe = 8 * 64 + 2 * 3 * 64 * 48 + 3 * 64 * 32 + 64  # router 512, two experts 18432, shared 6144, gate 64
    head = 64 * 300  # 19200
    assert matmul_parameters(tiny_moe()) == attention + dense_mlp + moe + head == 87_360
    scores = 12 * 2 * 32 * 4 * 16  # 49152: QK^T and the weighted sum over the 32 x 32 square, both layers
    assert training_flops_per_token(tiny_moe()) == 6 * 87_360 + scores == 573_312


def test_heads_wider_than_hidden_over_heads_by_hand():
    """Qwen3-0.6B: hidden 1024, 16 query heads and 8 KV groups 128 wide (q 2048 wide, not 1024), 28 layers, MLP
    3072, vocab 151936, seq 4096: QKV 1024 x (16 + 2 x 8) x 128 = 4,194,304 and projection 16 x 128 x 1024 =
    2,097,152 per layer; the attention square 12 x 28 x 4096 x 16 x 128."""
    cfg = ModelConfig(family="qwen3", num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                      head_dim=128, ffn_hidden_size=3072, seq_length=4096, vocab_size=151936)
    active = 28 * (4_194_304 + 2_097_152 + 3 * 1024 * 3072) + 1024 * 151936
    # the model card's 596,049,920 parameters less the norms (2 x 1024 + q/k 2 x 128 a layer, final 1024); the
    # tied embedding counts once, as the LM head's matmul
    assert matmul_parameters(cfg) == active == 596_049_920 - 28 * (2 * 1024 + 2 * 128) - 1024
    assert training_flops_per_token(cfg) == 6 * active + 12 * 28 * 4096 * 16 * 128


def test_experts_a_token_skips_cost_nothing():
    """More experts at the same top-k add only router weights; a larger top-k adds whole experts."""
    cfg = tiny_moe()
    base = matmul_parameters(cfg)
    cfg.num_experts = 64
    assert matmul_parameters(cfg) - base == (64 - 8) * 64
    cfg.moe_topk = 4
    assert matmul_parameters(cfg) - base == (64 - 8) * 64 + 2 * 3 * 64 * 48


def test_mixtral_8x7b_flops_per_token():
    """Per layer QKV 4096 x (32 + 2 x 8) x 128 = 25,165,824, projection 16,777,216, router 8 x 4096 = 32,768 and
    two of the 8 experts, 2 x 3 x 4096 x 14336 = 352,321,536 (all 8 would be 1,409,286,144); the LM head
    4096 x 32000. At seq 4096 the attention square adds 12 x 32 x 4096 x 4096."""
    cfg = ModelConfig(family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, seq_length=4096, vocab_size=32000, num_experts=8, moe_topk=2)
    active = 32 * (25_165_824 + 16_777_216 + 32_768 + 352_321_536) + 4096 * 32000
    assert matmul_parameters(cfg) == active == 12_748_587_008
    assert training_flops_per_token(cfg) == pytest.approx(6 * active + 12 * 32 * 4096 * 4096)
    assert training_flops_per_token(cfg) == pytest.approx(8.2934e10, rel=1e-4)


def gpt3_175b() -> ModelConfig:
    """The Megatron-LM paper's GPT-3: l 96, h 12288 (96 heads), s 2048, V 51200, MLP 4h."""
    return ModelConfig(family="gpt2", num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                       vocab_size=51200)


@pytest.mark.parametrize("batch", [1, 1536])
def test_gpt_flops_are_the_megatron_lm_papers_formulas(batch):
    """Narayanan et al. 2021 (Efficient Large-Scale Language Model Training on GPU Clusters), per step of B
    sequences: model FLOPs 72Bslh^2(1 + s/6h + V/12lh); with full recompute (the paper's count, one more
    forward of the layers but not of the LM head) 96Bslh^2(1 + s/6h + V/16lh). Exactly, in integers."""
    cfg = gpt3_175b()
    b, s, l, h, v = batch, cfg.seq_length, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    model = 72 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))
    hardware = 96 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))
    assert b * s * training_flops_per_token(cfg) == model
    assert b * s * hardware_flops_per_token(cfg, "full") == hardware
    assert hardware_flops_per_token(cfg, "none") == training_flops_per_token(cfg)


def test_selective_recompute_reruns_the_core_attention():
    """Selective recompute reruns QK^T and the weighted sum: 4 s h FLOPs per token per layer for GPT."""
    cfg = gpt3_175b()
    assert recomputed_flops_per_token(cfg, "selective") == 4 * 96 * 2048 * 12288


def test_recomputed_flops_of_a_tiny_moe_by_hand():
    """Full: every layer's forward again (24576 + 18432 + 24640 layer weights, 2 FLOPs each, and the attention
    square's forward, a third of its 49152); selective: the square plus the second projection of the two
    experts a token runs through (48 x 64 each) in the one MoE layer."""
    layers = 24576 + 18432 + (512 + 18432 + 6144 + 64)
    assert recomputed_flops_per_token(tiny_moe(), "full") == 2 * layers + 49152 // 3 == 152_704
    assert recomputed_flops_per_token(tiny_moe(), "selective") == 49152 // 3 + 2 * 2 * 48 * 64 == 28_672
    with pytest.raises(ValueError, match="'partial' is not one of none, selective, full"):
        recomputed_flops_per_token(tiny_moe(), "partial")


@pytest.mark.parametrize(("q_lora_rank", "query_weights"), [(16, 16 * 4 * 12), (None, 64 * 4 * 12)])
def test_selective_recompute_of_latent_attention_reruns_its_up_projections(q_lora_rank, query_weights):
    """Latent attention (4 heads of qk 8 + 4 and v 6, seq 32): per layer the core's 2 x 32 x 4 x (12 + 6) and
    the up-projections' weights twice: the query's (from a 16-wide latent, or from hidden 64 without query
    compression) and the key/value one's (an 8-wide latent into 4 x (8 + 6))."""
    cfg = ModelConfig(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                      ffn_hidden_size=96, seq_length=32, vocab_size=300, multi_latent_attention=True,
                      q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
    per_layer = 2 * 32 * 4 * (12 + 6) + 2 * (query_weights + 8 * 4 * 14)
    assert recomputed_flops_per_token(cfg, "selective") == 2 * per_layer


def test_throughput_reports_model_and_hardware_flops_side_by_side():
    cfg = tiny_moe()
    figures = throughput(1e6, cfg, "full", peak=2.0)
    assert figures["tflops_per_device"] == pytest.approx(573_312 / 1e6)
    assert figures["hardware_tflops_per_device"] == pytest.approx((573_312 + 152_704) / 1e6)
    assert figures["mfu"] == pytest.approx(figures["tflops_per_device"] / 2.0)
    assert figures["hfu"] == pytest.approx(figures["hardware_tflops_per_device"] / 2.0)
    assert throughput(1e6, cfg, "full", peak=None)["hfu"] is None


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_log_line_and_the_metrics_file_label_both(recompute, tmp_path, capsys):
    """Each logged step records model and hardware TFLOP/s (their ratio that of the FLOPs per token) and MFU
    and HFU (n/a on a CPU: no known peak); the console line shows the hardware figures only under recompute."""
    metrics = tmp_path / "metrics.jsonl"
    cfg = tiny_config(train={"train_iters": 2, "recompute": recompute}, logging={"metrics_file": str(metrics)})
    pretrain(cfg)
    ratio = hardware_flops_per_token(cfg.model, recompute) / training_flops_per_token(cfg.model)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in records:
        assert r["hardware_tflops_per_device"] / r["tflops_per_device"] == pytest.approx(ratio)
        assert r["mfu"] is None and r["hfu"] is None
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 2/2 |")][0]
    assert "| model TFLOP/s/device " in line and "| MFU n/a" in line
    assert ("| hardware TFLOP/s/device " in line and "| HFU n/a" in line) == (recompute == "full")
