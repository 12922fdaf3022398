"""The routed experts of one rank: every expert's MLP weights stacked, run over the tokens grouped by expert
with one grouped GEMM per projection (`torch._grouped_mm`), however unevenly the tokens fall.

Weights are stored as linear layers store theirs, [experts, out, in] (transformers v5 keeps Mixtral's and
Qwen3-MoE's experts fused the same way: gate_up_proj [E, 2I, H], down_proj [E, H, I]); a gated MLP's fc1
holds the gate rows, then the up rows, and the activation is the dense MLP's (model/mlp.py `activate`).
They live on the expert grid, split by expert over ep: each rank holds num_experts/ep consecutive experts,
and their gradients are reduced over the expert-data-parallel ranks.
Under expert tensor parallelism (etp) each expert's MLP is split as a dense one is over tp: fc1's output
features (gate and up each) and fc2's input features, so the output is a partial sum over the etp ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.config import ModelConfig
from megalite.model.mlp import activate
from megalite.parallel.context import ParallelContext
from megalite.parallel.placement import Placement, ShardSpec
from megalite.parallel.weight_grads import split_backward, weight_grad


def grouped_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands. On CUDA it takes bf16 only, with every row a multiple of
    16 bytes (8 elements: the hidden size and the experts' width), as its checks in torch/_meta_registrations.py
    (`_meta_grouped_mm_common`, mirroring aten/src/ATen/native/cuda/Blas.cpp) say; the group sizes need no
    alignment. On the CPU every float dtype runs (bf16 with the same 16-byte rows)."""
    rows_aligned = x.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and rows_aligned
    return x.dtype != torch.bfloat16 or rows_aligned


@torch.compiler.disable
def _eager_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Outside torch.compile: the compiler checks every grouped GEMM against the CUDA kernel's rules (bf16 only)."""
    return torch._grouped_mm(x, weight, offs=offs)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x [tokens, in] times weight[e] [out, in]^T, for every expert e, in x's
    dtype (the weights are cast as autocast would cast a linear layer's). `offsets` [experts] int32 are the
    cumulative token counts, on the device: no host read when the grouped kernel takes the operands; otherwise
    a loop over the experts reads them once. The weight gradient is handed to parallel/weight_grads.py (in W
    under a zero-bubble schedule); both gradients are the grouped kernel's own backward, bit for bit."""
    return _GroupedLinear.apply(x, weight, offsets)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    matmul = torch._grouped_mm if a.dtype == torch.bfloat16 else _eager_grouped_mm
    return matmul(a, b, offs=offsets)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        cast = weight.to(x.dtype)
        ctx.grouped = grouped_kernel_takes(x, cast)
        ctx.save_for_backward(x, offsets)
        ctx.weight = weight  # on ctx: a checkpoint's recompute would save a copy, not the parameter
        if not ctx.grouped:
            return torch.cat([F.linear(part, cast[e]) for e, part in enumerate(x.split(_sizes(offsets)))])
        return _grouped_mm(x, cast.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x, offsets = ctx.saved_tensors
        grad_x = split_backward(_grouped_backward, [x, grad.contiguous(), ctx.weight, offsets], grouped=ctx.grouped,
                                needs=tuple(ctx.needs_input_grad[:2]))
        return (grad_x if ctx.needs_input_grad[0] else None), None, None


def _sizes(offsets: torch.Tensor) -> list[int]:
    return torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()


def _grouped_backward(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                      grouped: bool, needs: tuple[bool, bool]) -> torch.Tensor:
    """dX, returned; dW (its rows grad_e^T x_e), handed to weight_grads."""
    cast = weight.to(x.dtype)
    if grouped:
        grad_x = _grouped_mm(grad, cast, offsets) if needs[0] else torch.empty_like(x)
        compute = lambda: _grouped_mm(grad.t(), x, offsets).to(weight.dtype)  # noqa: E731
    else:
        sizes = _sizes(offsets)
        parts = list(zip(grad.split(sizes), x.split(sizes)))
        grad_x = torch.cat([g.matmul(cast[e]) for e, (g, _) in enumerate(parts)]) if needs[0] else torch.empty_like(x)
        compute = lambda: torch.stack([g.t().matmul(part) for g, part in parts]).to(weight.dtype)  # noqa: E731
    if needs[1]:
        weight_grad(weight, compute)
    return grad_x


class ExpertLinear(nn.Module):
    """One projection of this rank's experts: weight [local experts, out, in], split over etp along `dim` (1:
    output features in `blocks` blocks, 2: input features)."""

    def __init__(self, experts: int, in_features: int, out_features: int, dim: int, blocks: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        self.placements = {"weight": Placement((("ep", ShardSpec(0)), ("etp", ShardSpec(dim, blocks))), "expert")}

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, offsets)


class GroupedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.gated, self.activation = cfg.features.gated_mlp, cfg.features.activation
        self.local = cfg.num_experts // ctx.ep.size
        width, blocks = cfg.expert_ffn_size // ctx.etp.size, 2 if self.gated else 1
        self.linear_fc1 = ExpertLinear(self.local, cfg.hidden_size, blocks * width, dim=1, blocks=blocks)
        self.linear_fc2 = ExpertLinear(self.local, width, cfg.hidden_size, dim=2)
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
        return self.linear_fc2(activate(h, self.activation, self.gated), offsets)
