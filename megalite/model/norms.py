"""Normalisation layers: NVIDIA apex's fused kernels on CUDA when installed, torch's otherwise.

Both compute the same function with the same parameters (`weight`, and `bias` for
LayerNorm), so checkpoints do not depend on which implementation ran.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn


def _apex_norm(name: str):
    """The apex class `name` when apex (the NVIDIA one) imports and CUDA is usable."""
    if not torch.cuda.is_available():
        return None
    try:
        return getattr(importlib.import_module("apex.normalization"), name)
    except (ImportError, AttributeError):
        return None


def build_norm(family: str, hidden_size: int, eps: float, device: torch.device) -> nn.Module:
    if family == "gpt2":
        fused = _apex_norm("FusedLayerNorm") if device.type == "cuda" else None
        return fused(hidden_size, eps=eps) if fused else nn.LayerNorm(hidden_size, eps=eps)
    fused = _apex_norm("FusedRMSNorm") if device.type == "cuda" else None
    return fused(hidden_size, eps=eps) if fused else nn.RMSNorm(hidden_size, eps=eps)
