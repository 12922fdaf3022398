"""Tiny random transformers models of the mixture-of-experts and q/k-norm architectures, built from configs
here (no hub): Mixtral, dense Qwen3, Qwen3-MoE with a dense first layer and unnormalised top-k weights.

Their routers are redrawn with std 0.3 so that the router logits of a token (std about 2.5) lie far apart:
the k-th and (k+1)-th best experts then differ by much more than fp32 round-off (`routing_margin` says by how
much), and both codebases choose the same experts (HF initialises Qwen3-MoE's router to zeros: every choice
would be a tie), while the softmax is not so peaked that unnormalised top-k weights already sum to 1. Norm
weights are drawn around 1, so a norm mapped to the wrong tensor shows in the logits.
"""

from __future__ import annotations

import torch
import transformers

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


@torch.no_grad()
def spread_routers_and_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw router weights (HF `mlp.gate.weight`, megalite `mlp.router.weight`) with std 0.3 and norm weights
    uniformly in [0.5, 1.5), in place."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        elif "norm" in name:
            param.copy_(0.5 + torch.rand(param.shape, generator=generator))


def random_hf(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """The tiny random fp32 model `name` (a key of MODELS), in eval mode."""
    config_class, fields = MODELS[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**TINY, **fields)).eval()
    spread_routers_and_norms(model, seed)
    return model


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
