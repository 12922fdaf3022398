"""The feed-forward block: GELU (tanh approximation, as GPT-2) or SwiGLU (as Llama).

SwiGLU's gate and up projections are one fused matrix, gate rows first then up rows;
tensor parallelism splits each half separately so every rank holds matching slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.family == "llama"
        bias = cfg.family == "gpt2"
        fc1_rows = 2 * cfg.ffn_size if self.swiglu else cfg.ffn_size
        self.linear_fc1 = nn.Linear(cfg.hidden_size, fc1_rows, bias=bias)
        self.linear_fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.linear_fc2(h)
