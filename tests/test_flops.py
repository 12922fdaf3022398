"""Model FLOPs per token (megalite/training/flops.py), worked out by hand: a mixture-of-experts layer counts the
weights one token multiplies (router, its top-k experts, shared expert and gate), never the experts it skips."""

from __future__ import annotations

import pytest

from megalite.config import ModelConfig
from megalite.training.flops import matmul_parameters, training_flops_per_token


def tiny_moe() -> ModelConfig:
    """Llama, 2 layers, hidden 64, 4 heads of 16, 2 KV groups, seq 32, vocab 300; layer 0 a dense SwiGLU MLP 96
    wide, layer 1 8 experts 48 wide (top 2) with a 32-wide shared expert and its gate."""
    return ModelConfig(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=96, seq_length=32, vocab_size=300, num_experts=8, moe_topk=2,
                       moe_ffn_hidden_size=48, moe_shared_expert_size=32, moe_shared_expert_gate=True,
                       moe_first_dense_layers=1)


def test_active_flops_of_a_tiny_moe_by_hand():
    attention = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64)  # QKV 8192 + projection 4096, two layers: 24576
    dense_mlp = 3 * 64 * 96  # 18432
    moe = 8 * 64 + 2 * 3 * 64 * 48 + 3 * 64 * 32 + 64  # router 512, two experts 18432, shared 6144, gate 64
    head = 64 * 300  # 19200
    assert matmul_parameters(tiny_moe()) == attention + dense_mlp + moe + head == 87_360
    scores = 12 * 2 * 32 * 4 * 16  # 49152: QK^T and the weighted sum over the 32 x 32 square, both layers
    assert training_flops_per_token(tiny_moe()) == 6 * 87_360 + scores == 573_312


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
