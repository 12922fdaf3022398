"""AdamW with decoupled weight decay; no decay on biases and norm weights.

torch's fused AdamW: one multi-tensor kernel for the whole update, on CPU and CUDA alike. It is the
upstreamed form of NVIDIA apex's FusedAdam (pytorch/pytorch#71274), so megalite no longer uses apex's:
apex kept Adam's step in the param groups, where checkpoints did not find it, and a resume silently
restarted Adam's moments. One optimizer means one checkpoint format for its state.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.config import OptimConfig
from megalite.parallel.grads import decay_groups


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    return decay_groups(((n, p, p) for n, p in model.named_parameters() if p.requires_grad), weight_decay)


def build_optimizer(groups: list[dict], cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over `groups` (see param_groups / GradientReducer.param_groups)."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
