"""DeepSeek-V3-class models as released (DeepSeek-V3/R1, Kimi K2, Moonlight).

- Routing equals transformers' DeepseekV3TopkRouter: sigmoid scores, the expert bias choosing only, group-limited
  selection by the sum of each group's two best scores (model.moe_router_group_experts=2; the default, Megatron's
  k / group_topk, chooses other groups where k != 2 x topk_group), renormalised, times routed_scaling_factor.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from megalite.config import ModelConfig
from megalite.model.moe.router import route


def test_released_group_routing_equals_transformers_router():
    """k 6 of 16 experts in 4 groups, the best 2 groups: Megatron's group score (best 3) differs from the released
    one (best 2) for some tokens."""
    hf_cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=6, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.3, generator=gen)
    x = torch.randn(64, 16, generator=gen)
    _, hf_weights, hf_experts = router(x)
    cfg = ModelConfig(family="llama", num_experts=16, moe_topk=6, moe_router="sigmoid", moe_router_groups=4,
                      moe_router_group_topk=2, moe_scaling_factor=2.5, moe_norm_topk_prob=True,
                      moe_router_group_experts=2)
    logits = x @ router.weight.t()
    ours = route(logits, cfg, router.e_score_correction_bias)
    order, hf_order = ours.experts.argsort(-1), hf_experts.argsort(-1)
    assert torch.equal(ours.experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(ours.weights.gather(1, order), hf_weights.gather(1, hf_order))
    cfg.moe_router_group_experts = None  # Megatron-Core's rule: some tokens choose other experts
    assert not torch.equal(route(logits, cfg, router.e_score_correction_bias).experts.sort(-1).values,
                           hf_experts.sort(-1).values)
