"""The feed-forward block: activation(fc1(x)), or gated, activation(gate) * up (SwiGLU with silu, as Llama),
then fc2. The activation (model.activation) is GELU's tanh approximation (GPT-2), exact GELU (Megatron-LM's
GPT) or SiLU; the routed experts (model/moe/experts.py) apply it the same way.

A gated MLP's gate and up projections are one fused matrix, gate rows first then up rows;
tensor parallelism splits each half separately so every rank holds matching slices.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.context import ParallelContext
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear

ACTIVATIONS = {"gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def activate(h: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """fc1's output -> fc2's input: activation(h), or with a gated MLP activation(gate) * up of h = [gate | up]."""
    if not gated:
        return ACTIVATIONS[activation](h)
    gate, up = h.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, width: int | None = None) -> None:
        """`width`: the hidden width (default: the model's MLP width; a shared expert's is its own)."""
        super().__init__()
        features = cfg.features
        self.gated, self.activation = features.gated_mlp, features.activation
        blocks, width = 2 if self.gated else 1, width or cfg.ffn_size
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, blocks * width, ctx, features.bias, blocks=blocks)
        self.linear_fc2 = RowParallelLinear(width, cfg.hidden_size, ctx, features.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(self.linear_fc1(x), self.activation, self.gated))
