"""Activation recompute, applied to a built model (as torchtitan's parallelize step applies it).

The model's constructor knows only the architecture; how much of the forward backward recomputes
instead of keeping is a training choice (train.recompute), set here on the layers in place. No
module is wrapped, so parameter names, and with them checkpoints, stay the one-device ones.
Recompute replays the RNG tracker's state (parallel/random.py checkpoint_with_rng), so dropout
draws the same masks as in the forward.
"""

from __future__ import annotations

from typing import Literal

from megalite.model.gpt import GPTModel
from megalite.model.latent_attention import LatentAttention
from megalite.model.moe.layer import MoELayer


def apply_recompute(model: GPTModel, mode: Literal["none", "selective", "full"]) -> None:
    """full: each transformer layer keeps only its input and reruns whole in backward; selective: only the
    core attention (softmax(QK^T)V) reruns, from its kept q, k, v (under latent attention with the
    up-projections and the queries' RoPE before it, from the kept latents: Megatron-Core's mla_up_proj), and the
    experts' activation with their second projection, from the first's output; none: autograd keeps everything.
    Only training forwards recompute (eval and generation never do)."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute mode {mode!r} is not one of none, selective, full")
    for layer in model.transformer_layers():
        layer.recompute = mode == "full"
        layer.attention.recompute_core = mode == "selective"
        if isinstance(layer.attention, LatentAttention):
            layer.attention.recompute_up_proj = mode == "selective"
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.experts.recompute_activation = mode == "selective"
