"""The mixture-of-experts block that takes a dense MLP's place: route, dispatch, run the experts, combine,
plus an optional always-on shared expert (DeepSeek, Qwen2-MoE), optionally gated by a sigmoid.

It takes and returns what an MLP does, [seq (/tp under SP), batch, hidden]; under sequence parallelism each
tensor-parallel rank routes its own slice of the tokens (so tp > 1 needs SP: without it every tp rank would
send the same tokens). The tokens travel in the compute dtype (half the bytes under bf16 autocast).

Its costs (model/costs.py) are its parts': the router's, the dispatcher's for the rows balanced routing brings
this rank's experts, the experts', and the shared expert's, a dense MLP gated by a sigmoid.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.model.aux_losses import AuxLosses
from megalite.model.costs import MicroBatch, kept_input_bytes, matmul_held, row_bias_held
from megalite.model.mlp import MLP
from megalite.model.moe.dispatch import DISPATCHERS, AllToAll, Sorted
from megalite.model.moe.experts import GroupedExperts
from megalite.model.moe.router import Router
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.expert_parallel import balanced_split_sizes
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

    def saved_bytes(self, batch: MicroBatch) -> int:
        """The routed part for the rank's rows, and the shared expert: its MLP's tensors past the input and, gated,
        the gate's input and output; the router keeps the input as fp32, the shared expert's fc1 and gate keep it
        in the compute dtype: the same tensor when no cast is needed (the router's when that is fp32), else a copy
        each; fc1 keeps an FP8 copy instead where its recipe says (parallel/fp8/recipes.py)."""
        hidden, rows = self.router.weight.shape[1], self.dispatcher.routed_rows(batch.rows)
        size = (self.router.saved_bytes(batch) + self.dispatcher.saved_bytes(rows, hidden)
                + self.experts.rows_saved(rows, batch.compute))
        if self.shared_expert is None:
            return size
        gated, c = self.shared_expert_gate is not None, batch.compute
        own, fc1 = batch.rows * hidden * c, kept_input_bytes(self.shared_expert.linear_fc1, batch.rows, c)
        quantised = fc1 != own  # fc1 keeps an FP8 copy (its recipe's), not the input
        if c != batch.residual:  # fc1 and the gate each cast a copy
            inputs = fc1 + (own if gated else 0)
        else:  # one tensor: the router's when fp32 (counted there), else kept by the gate, or by fc1 if not in FP8
            inputs = (own if c != 4 and (gated or not quantised) else 0) + (fc1 if quantised else 0)
        gate = batch.rows * (hidden + 1) * c if gated else 0
        return size + inputs + self.shared_expert.activation_bytes(batch) + gate

    def backward_transient_bytes(self, batch: MicroBatch) -> int:
        """The combine's, over the rows balanced routing brings (model/moe/dispatch.py): the routed part's backward
        starts with it, before any expert's gradient is made."""
        return Sorted.backward_transient_bytes(self.dispatcher.routed_rows(batch.rows), self.router.weight.shape[1])

    def held_bytes(self, batch: MicroBatch) -> int:
        """The router's, the experts' over their routed rows, the shared expert's and its gate's."""
        size = self.router.held_bytes(batch)
        size += self.experts.rows_held(self.dispatcher.routed_rows(batch.rows), batch.compute)
        if self.shared_expert is not None:
            size += self.shared_expert.matmuls_held(batch.rows, batch.compute)
            size += row_bias_held(self.shared_expert.linear_fc2, batch)
        if self.shared_expert_gate is not None:
            size += matmul_held(self.shared_expert_gate, batch.rows, batch.compute)
        return size

    def matmul_parameters(self) -> int:
        gate = self.shared_expert_gate.numel() if self.shared_expert_gate is not None else 0
        shared = self.shared_expert.matmul_parameters() if self.shared_expert is not None else 0
        return self.router.matmul_parameters() + self.experts.matmul_parameters() + shared + gate

def assume_balanced_routing(model: nn.Module) -> None:
    """Every all-to-all dispatcher in `model` takes the split sizes of balanced routing (the planner's assumption,
    parallel/expert_parallel.py) instead of reading them from the device: for a run whose tensors hold no values,
    the dry run's. Changes a built model, as model/recompute.py's apply_recompute does."""
    for module in model.modules():
        if isinstance(module, MoELayer) and isinstance(module.dispatcher, AllToAll):
            module.dispatcher.travel.split_sizes = balanced_split_sizes
