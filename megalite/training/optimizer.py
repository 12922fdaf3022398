"""AdamW with decoupled weight decay; no decay on biases and norm weights.

Uses NVIDIA apex's FusedAdam on CUDA when apex is installed, else torch's fused AdamW
(one kernel for the whole update, on CPU and CUDA alike).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from megalite.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith("bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _apex_fused_adam():
    try:
        return importlib.import_module("apex.optimizers").FusedAdam
    except (ImportError, AttributeError):
        return None


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    fused_adam = _apex_fused_adam() if device.type == "cuda" else None
    if fused_adam is not None:
        return fused_adam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, fused=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
