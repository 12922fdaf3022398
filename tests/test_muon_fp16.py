"""Muon under fp16 with dynamic loss scaling (training/loss_scaler.py): the gradients are unscaled before the update
(training/step.py), so Muon's momentum holds true gradients whatever the scale, and an overflow step is skipped
before Muon runs: weights and momentum stay as they were."""

from __future__ import annotations

import pytest
import torch
from distributed import cpu_topology, run_ranks
from test_muon import MUON, _batches

from megalite.config_cli import parse_config
from megalite.training.build import build_trainer
from megalite.training.step import train_step


def _fp16_steps(rank: int, world_size: int, scale: float) -> tuple[list[bool], dict, list[list], bool]:
    """Two fp16 steps from loss scale `scale`: whether each overflowed, the main weights after them, whether Muon's
    momentum's norms after each (one per matrix), and whether the weights were still the initial ones."""
    cfg = parse_config([*MUON, "--train.precision=fp16", f"--optim.initial_loss_scale={scale}",
                        "--optim.hysteresis=1"])
    topology = cpu_topology(rank, world_size, cfg)
    with build_trainer(cfg, topology) as parts:
        before = [m.main.clone() for m in parts.optimizer.shards()]
        overflows, momentum = [], []
        for step in range(2):
            overflows.append(train_step(parts, _batches(cfg, topology, step)).overflow)
            momentum.append([s["momentum_buffer"].norm().item() for s in parts.optimizer.optimizer.state.values()
                             if "momentum_buffer" in s])
        after = {m.name: m.main.clone() for m in parts.optimizer.shards()}
        return overflows, after, momentum, all(torch.equal(a, b) for a, b in zip(after.values(), before))


def test_muon_trains_in_fp16_with_loss_scaling():
    """Scales 2^8 and 2^14 (neither overflows) reach the same Muon matrices: the scale never reaches Muon. At 2^40 both
    steps overflow (2^40, then 2^39) and are skipped: no momentum made, the weights as they were."""
    (low, low_weights, low_made, _), (high, high_weights, made, _), (huge, _, huge_made, unchanged) = (
        run_ranks(1, _fp16_steps, scale)[0] for scale in (2.0**8, 2.0**14, 2.0**40))
    assert low == high == [False, False] and all(made)
    assert made[-1] == pytest.approx(low_made[-1], rel=1e-3)  # a scaled gradient would make it 2^6 times larger
    for name in (name for name in low_weights if ".linear_" in name):  # fp16's and bf16's rounding of the update
        torch.testing.assert_close(low_weights[name], high_weights[name], rtol=0, atol=2e-3)
    assert huge == [True, True] and huge_made == [[], []] and unchanged
