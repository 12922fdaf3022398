"""Normalisation layers: NVIDIA apex's fused kernels on CUDA when installed, torch's otherwise.
apex's norms keep only what backward needs; on CUDA torch's RMSNorm is a fused kernel too (it keeps its input
and rstd, measured on an H100, see the planner). apex's are unmeasured: the GPU we ran on had no apex.

Both compute the same function with the same parameters (`weight`, and `bias` for
LayerNorm), so checkpoints do not depend on which implementation ran.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn


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


def build_norm(kind: str, hidden_size: int, eps: float, device: torch.device) -> nn.Module:
    """A `kind` ("layernorm" or "rmsnorm", model.norm) norm over the last dimension."""
    if kind == "layernorm":
        fused = _apex_norm("FusedLayerNorm") if device.type == "cuda" else None
        return fused(hidden_size, eps=eps) if fused else nn.LayerNorm(hidden_size, eps=eps)
    fused = _apex_norm("FusedRMSNorm") if device.type == "cuda" else None
    return fused(hidden_size, eps=eps) if fused else nn.RMSNorm(hidden_size, eps=eps)
