"""The mixture-of-experts block that takes a dense MLP's place: route, dispatch, run the experts, combine,
plus an optional always-on shared expert (DeepSeek, Qwen2-MoE), optionally gated by a sigmoid.

It takes and returns what an MLP does, [seq (/tp under SP), batch, hidden]; under sequence parallelism each
tensor-parallel rank routes its own slice of the tokens (so tp > 1 needs SP: without it every tp rank would
send the same tokens). The tokens travel in the compute dtype (half the bytes under bf16 autocast).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.model.aux_losses import AuxLosses
from megalite.model.mlp import MLP
from megalite.model.moe.dispatch import DISPATCHERS
from megalite.model.moe.experts import GroupedExperts
from megalite.model.moe.router import Router
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.mappings import in_compute_dtype


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, aux_losses: AuxLosses, layer: int) -> None:
        super().__init__()
        self.router = Router(cfg, ctx, aux_losses, layer)
        self.experts = GroupedExperts(cfg, ctx)
        self.dispatcher = DISPATCHERS[ctx.expert_dispatcher](ctx, cfg)
        self.shared_expert = MLP(cfg, ctx, cfg.moe_shared_expert_size) if cfg.moe_shared_expert_size else None
        self.shared_expert_gate = None
        if cfg.moe_shared_expert_size and cfg.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Parameter(torch.empty(1, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.router(x)
        tokens = in_compute_dtype(x).reshape(-1, x.shape[-1])
        rows, counts, state = self.dispatcher.dispatch(tokens, routing)
        out = self.dispatcher.combine(self.experts(rows, counts), state).view(*x.shape[:-1], -1)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = shared * gemm.linear(x, self.shared_expert_gate).sigmoid()
        return out + shared
