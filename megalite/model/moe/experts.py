"""The routed experts of one rank: every expert's MLP weights stacked, run over the tokens grouped by expert
with one grouped GEMM per projection (parallel/gemm.py `grouped_linear`), however unevenly the tokens fall.

Weights are stored as linear layers store theirs, [experts, out, in] (transformers v5 keeps Mixtral's and
Qwen3-MoE's experts fused the same way: gate_up_proj [E, 2I, H], down_proj [E, H, I]); a gated MLP's fc1
holds the gate rows, then the up rows, and the activation is the dense MLP's (model/mlp.py `activate`).
They live on the expert grid, split by expert over ep: each rank holds num_experts/ep consecutive experts,
and their gradients are reduced over the expert-data-parallel ranks.
Under expert tensor parallelism (etp) each expert's MLP is split as a dense one is over tp: fc1's output
features (gate and up each) and fc2's input features, so the output is a partial sum over the etp ranks.
With model.bias (gpt-oss) each projection has a bias per expert, [experts, out], added to the rows of that
expert; fc1's is split with its output features, fc2's is added by etp rank 0 alone (to the partial sums), so its
gradient is partial over etp, as its placement says.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.config import ModelConfig
from megalite.model.costs import matmul_held
from megalite.model.mlp import activate, activation_bytes
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.placement import Placement, ShardSpec


class ExpertLinear(nn.Module):
    """One projection of this rank's experts: weight [local experts, out, in], split over etp along `dim` (1:
    output features in `blocks` blocks, 2: input features), multiplied by parallel/gemm.py's grouped matmul
    with this projection's `recipe`; with `bias` a bias [local experts, out], split with the
    output features (dim 1) or, when they are partial sums (dim 2), added by `ctx`'s etp rank 0 alone (the others
    hand it a zero gradient, so that every rank's buckets fill as in any backward)."""

    def __init__(self, experts: int, in_features: int, out_features: int, dim: int, blocks: int = 1,
                 bias: bool = False, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        self.placements = {"weight": Placement((("ep", ShardSpec(0)), ("etp", ShardSpec(dim, blocks))), "expert")}
        self.recipe = gemm.HIGH_PRECISION
        self.operand_splits = gemm.ONE_DEVICE if ctx is None else ctx.operand_splits(
            *(("etp", None) if dim == 1 else (None, "etp")), experts=True)
        self.bias = nn.Parameter(torch.empty(experts, out_features)) if bias else None
        self.adds_bias = bias and (dim == 1 or ctx is None or ctx.etp.rank == 0)
        if bias and dim == 1:
            self.placements["bias"] = Placement((("ep", ShardSpec(0)), ("etp", ShardSpec(1, blocks))), "expert")
        elif bias:
            etp = ctx is not None and ctx.etp.size > 1
            self.placements["bias"] = Placement((("ep", ShardSpec(0)),), "expert", partial=("etp",) if etp else ())

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return gemm.grouped_linear(x, self.weight, offsets, self.recipe, self.bias, self.adds_bias)


class GroupedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.features = features = cfg.features
        self.local, self.topk = cfg.num_experts // ctx.ep.size, cfg.moe_topk
        width, blocks = cfg.expert_ffn_size // ctx.etp.size, 2 if features.gated_mlp else 1
        self.linear_fc1 = ExpertLinear(self.local, cfg.hidden_size, blocks * width, dim=1, blocks=blocks,
                                       bias=features.bias, ctx=ctx)
        self.linear_fc2 = ExpertLinear(self.local, width, cfg.hidden_size, dim=2, bias=features.bias, ctx=ctx)
        # Selective recompute (model/recompute.py): keep fc1's output only; backward reruns the activation and fc2's
        # forward (one more grouped GEMM, about a ninth of the experts' work) instead of keeping fc2's input.
        self.recompute_activation = False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] grouped by local expert, `counts` [local experts] tokens each (on the device)."""
        offsets = counts.cumsum(0).to(torch.int32)
        h = self.linear_fc1(x, offsets)
        if self.recompute_activation and self.training:
            return checkpoint(self._activation_and_fc2, h, offsets, use_reentrant=False)
        return self._activation_and_fc2(h, offsets)

    def _activation_and_fc2(self, h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(h, self.features), offsets)

    def rows_saved(self, rows: int, compute: int) -> int:
        """What the experts keep running `rows` rows, in the compute dtype (the grouped GEMM casts fp32 weights inside
        its autograd function and keeps the parameter, as gemm.py does): the rows in, the offsets (int32 per local
        expert), and fc1's output and the activation's tensors, as a dense MLP's (model/mlp.py); under selective
        recompute fc1's output alone, the checkpoint's input."""
        width, fc1 = self.linear_fc2.weight.shape[-1], self.linear_fc1.weight.shape[-2]
        kept = rows * self.linear_fc1.weight.shape[-1] * compute + self.local * 4
        if self.recompute_activation:
            return kept + rows * fc1 * compute
        return kept + activation_bytes(self.features, False, rows, width, compute)

    def rows_held(self, rows: int, compute: int) -> int:
        """Both grouped GEMMs' input and output gradient for `rows` rows."""
        return matmul_held(self.linear_fc1.weight, rows, compute) + matmul_held(self.linear_fc2.weight, rows, compute)

    def _per_expert(self, *linears: ExpertLinear) -> int:
        return sum(linear.weight.numel() for linear in linears) // self.local

    def matmul_parameters(self) -> int:
        """A token runs through its top-k experts; those it skips cost nothing."""
        return self.topk * self._per_expert(self.linear_fc1, self.linear_fc2)

    def active_parameters(self) -> int:
        """A token's top-k experts' weights and biases."""
        return self.topk * sum(p.numel() for p in self.parameters()) // self.local

    def recomputed_flops(self, seq: int) -> int:
        """Selective recompute reruns fc2 of the top-k experts."""
        return 2 * self.topk * self._per_expert(self.linear_fc2) if self.recompute_activation else 0
