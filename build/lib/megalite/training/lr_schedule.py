"""Learning rate as a pure function of the step, so a resumed run needs only the step."""

from __future__ import annotations

import math

from megalite.config import OptimConfig


def learning_rate(step: int, cfg: OptimConfig, train_iters: int) -> float:
    """LR for optimizer update number `step` (counting from 1): linear warmup, then decay to min_lr."""
    decay_iters = cfg.decay_iters or train_iters
    if cfg.warmup_iters and step <= cfg.warmup_iters:
        return cfg.lr * step / cfg.warmup_iters
    if cfg.decay_style == "constant":
        return cfg.lr
    if step >= decay_iters:
        return cfg.min_lr
    if cfg.decay_style == "wsd":
        phase = cfg.wsd_decay_iters if cfg.wsd_decay_iters is not None else round(0.2 * decay_iters)
        start = decay_iters - phase
        if step <= start:
            return cfg.lr
        progress = (step - start) / phase
    else:
        progress = (step - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)
    if cfg.decay_style == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
