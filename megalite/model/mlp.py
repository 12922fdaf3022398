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
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.swiglu, bias = cfg.features.gated_mlp, cfg.features.bias
        blocks = 2 if self.swiglu else 1
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, blocks * cfg.ffn_size, ctx, bias, blocks=blocks)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, ctx, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.linear_fc2(h)
