"""The fp16 dynamic loss scale policy: hysteresis before halving, growth after a clean window."""

from __future__ import annotations

import torch

from megalite.config import OptimConfig
from megalite.training.loss_scaler import LossScaler


def test_hysteresis_window_and_floor():
    scaler = LossScaler.for_precision("fp16", OptimConfig(initial_loss_scale=8.0, hysteresis=2, loss_scale_window=3,
                                                          min_loss_scale=2.0))
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(True)
    assert scaler.scale == 4.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 8.0 and scaler.hysteresis_left == 2
    for _ in range(6):
        scaler.update(True)
    assert scaler.scale == 2.0


def test_unscale_detects_inf_and_divides():
    scaler = LossScaler.for_precision("fp16", OptimConfig(initial_loss_scale=4.0))
    grads = [torch.full((3,), 8.0), torch.ones(2)]
    assert not scaler.unscale_and_check(grads)
    assert torch.equal(grads[0], torch.full((3,), 2.0))
    assert scaler.unscale_and_check([torch.tensor([1.0, float("inf")])])


def test_bf16_and_fp32_never_scale():
    scaler = LossScaler.for_precision("bf16", OptimConfig())
    assert scaler.scale == 1.0 and not scaler.unscale_and_check([torch.tensor([float("inf")])])
