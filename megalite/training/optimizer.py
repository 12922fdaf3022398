"""AdamW with decoupled weight decay; no decay on biases and norm weights.

Uses NVIDIA apex's FusedAdam on CUDA when apex is installed, else torch's fused AdamW
(one kernel for the whole update, on CPU and CUDA alike).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from megalite.config import OptimConfig
from megalite.parallel.grads import decay_groups


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    return decay_groups(((n, p, p) for n, p in model.named_parameters() if p.requires_grad), weight_decay)


def _apex_fused_adam():
    try:
        return importlib.import_module("apex.optimizers").FusedAdam
    except (ImportError, AttributeError):
        return None


def build_optimizer(groups: list[dict], cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over `groups` (see param_groups / GradientReducer.param_groups)."""
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    fused_adam = _apex_fused_adam() if device.type == "cuda" else None
    if fused_adam is not None:
        return fused_adam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, fused=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
