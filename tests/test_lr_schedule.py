"""LR schedules: warmup, then cosine / linear / constant / WSD decay to min_lr."""

from __future__ import annotations

import math

import pytest

from megalite.config import OptimConfig
from megalite.training.lr_schedule import learning_rate


def _cfg(**kw) -> OptimConfig:
    return OptimConfig(lr=1.0, min_lr=0.1, warmup_iters=10, **kw)


def test_warmup_is_linear_from_zero():
    cfg = _cfg()
    assert [learning_rate(s, cfg, 100) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])


@pytest.mark.parametrize("style, midpoint", [("cosine", 0.55), ("linear", 0.55), ("constant", 1.0)])
def test_decay_styles(style, midpoint):
    cfg = _cfg(decay_style=style)
    assert learning_rate(55, cfg, 100) == pytest.approx(midpoint)
    assert learning_rate(100, cfg, 100) == pytest.approx(1.0 if style == "constant" else 0.1)
    assert learning_rate(150, cfg, 100) == pytest.approx(1.0 if style == "constant" else 0.1)


def test_cosine_shape():
    cfg = _cfg(decay_style="cosine")
    progress = (32.5 - 10) / 90
    assert learning_rate(32.5, cfg, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def test_wsd_holds_then_decays_over_its_phase():
    cfg = _cfg(decay_style="wsd", wsd_decay_iters=20)
    assert learning_rate(50, cfg, 100) == 1.0 and learning_rate(80, cfg, 100) == 1.0
    assert learning_rate(90, cfg, 100) == pytest.approx(0.55) and learning_rate(100, cfg, 100) == pytest.approx(0.1)


def test_decay_iters_shorter_than_training():
    cfg = _cfg(decay_style="linear", decay_iters=50)
    assert learning_rate(50, cfg, 100) == pytest.approx(0.1) and learning_rate(80, cfg, 100) == pytest.approx(0.1)
