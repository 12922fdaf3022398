"""The feed-forward block: GELU (tanh approximation, as GPT-2) or SwiGLU (as Llama).

SwiGLU's gate and up projections are one fused matrix, gate rows first then up rows;
tensor parallelism splits each half separately so every rank holds matching slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.context import ParallelContext
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, width: int | None = None) -> None:
        """`width`: the hidden width (default: the model's MLP width; a shared expert's is its own)."""
        super().__init__()
        self.swiglu, bias = cfg.features.gated_mlp, cfg.features.bias
        blocks, width = 2 if self.swiglu else 1, width or cfg.ffn_size
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, blocks * width, ctx, bias, blocks=blocks)
        self.linear_fc2 = RowParallelLinear(width, cfg.hidden_size, ctx, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.linear_fc2(h)
