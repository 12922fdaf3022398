"""Normalisation layers: NVIDIA apex's fused kernels on CUDA when installed, torch's otherwise.
apex's norms keep only what backward needs; on CUDA torch's RMSNorm is a fused kernel too (it keeps its input
and rstd, measured on an H100, see the planner). apex's are unmeasured: the GPU we ran on had no apex.

Both compute the same function with the same parameters (`weight`, and `bias` for
LayerNorm), so checkpoints do not depend on which implementation ran.

When the schedule splits the backward into B and W (zero bubble), `build_norm(..., split_backward=True)`
gives torch's norm modules whose forward runs through weight_grads.recomputed: it keeps only the input and
recomputes the norm in backward, for the input gradient in B and the weight's (and bias's) in W, with the
kernels of the module's own backward (apex is not used there). They stay modules with the same parameter
names, so checkpoints and module hooks (ZeRO-3's gathers) see nothing new.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.weight_grads import recomputed


def _apex_norm(name: str):
    """The apex class `name` when NVIDIA apex is installed with its compiled extension and CUDA is usable.
    A Python-only apex build (or PyPI's unrelated `apex`) imports fine and fails at the first forward,
    so the extension itself must import."""
    if not torch.cuda.is_available():
        return None
    try:
        importlib.import_module("fused_layer_norm_cuda")
        return getattr(importlib.import_module("apex.normalization"), name)
    except (ImportError, AttributeError):
        return None


def build_norm(kind: str, hidden_size: int, eps: float, device: torch.device,
               split_backward: bool = False) -> nn.Module:
    """A `kind` ("layernorm" or "rmsnorm", model.norm) norm over the last dimension; `split_backward`: its
    weight gradients computed apart from its input's (in W)."""
    if split_backward:
        return SplitLayerNorm(hidden_size, eps=eps) if kind == "layernorm" else SplitRMSNorm(hidden_size, eps=eps)
    if kind == "layernorm":
        fused = _apex_norm("FusedLayerNorm") if device.type == "cuda" else None
        return fused(hidden_size, eps=eps) if fused else nn.LayerNorm(hidden_size, eps=eps)
    fused = _apex_norm("FusedRMSNorm") if device.type == "cuda" else None
    return fused(hidden_size, eps=eps) if fused else nn.RMSNorm(hidden_size, eps=eps)


class SplitLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(_layer_norm, x, self.weight, self.bias, shape=tuple(self.normalized_shape), eps=self.eps)


class SplitRMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(_rms_norm, x, self.weight, shape=tuple(self.normalized_shape), eps=self.eps)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, shape: tuple[int, ...],
                eps: float) -> torch.Tensor:
    return F.layer_norm(x, shape, weight, bias, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, *, shape: tuple[int, ...], eps: float | None) -> torch.Tensor:
    return F.rms_norm(x, shape, weight, eps)
