"""A pipeline schedule is its ScheduleSpec (parallel/pipeline/spec.py): one registered in a test is validated,
planned, dry-run and trained like the built-in ones, without an edit anywhere else; and evaluation runs on the
training schedule's own stages (it ran on the loop order's under ZB-V, whose V puts the head on rank 0, and
failed there)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks
from parity import train_and_gather

from megalite.config import ConfigError
from megalite.config_cli import help_text
from megalite.config_validation import validate
from megalite.dryrun.pipeline_plan import check_pipeline
from megalite.model.norms import RecomputedLayerNorm
from megalite.parallel.context import ParallelContext
from megalite.parallel.pipeline.one_f_one_b import one_f_one_b_bubble
from megalite.parallel.pipeline.ops import B, F, Op, W
from megalite.parallel.pipeline.registry import register, unregister
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.planning.bubble import simulated_bubble
from megalite.planning.memory import chunk_held_bytes, peak_activations
from megalite.planning.plan import make_plan, schedule_plans
from megalite.training.build import build_model


def _last_in_first_out(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Every forward, then the backwards newest first, each B followed by its W."""
    return [Op(F, 0, i) for i in range(m)] + [op for i in reversed(range(m)) for op in (Op(B, 0, i), Op(W, 0, i))]


LIFO = ScheduleSpec("lifo-test", _last_in_first_out, one_f_one_b_bubble, split_backward=True, vp=1,
                    doc="a test's schedule: all forwards, then the backwards newest first")


@pytest.fixture
def lifo():
    register(LIFO)
    yield LIFO
    unregister(LIFO.name)


def _config(schedule: str, **parallel):
    return tiny_config("gpt2", model={"num_layers": 4},
                       parallel={"pp": 2, "pipeline_schedule": schedule, **parallel},
                       train={"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 3},
                       data={"num_workers": 0})


def test_a_registered_schedule_is_validated_planned_and_dry_run(lifo):
    with pytest.raises(ConfigError, match="pipeline_schedule='lifo-test' is not a training schedule; use one of"):
        unregister(lifo.name)
        validate(_config(lifo.name), 2)
    register(lifo)
    cfg = _config(lifo.name)
    validate(cfg, 2)
    with pytest.raises(ConfigError, match="lifo-test runs 1 model chunk per pipeline rank: set parallel.vp=1"):
        validate(_config(lifo.name, vp=2), 2)
    assert "lifo-test: a test's schedule" in help_text()
    plan = make_plan(cfg, 2)
    assert plan.bubble_formula == pytest.approx(1 / 4)  # its formula: (pp - 1) / m
    assert plan.bubble == pytest.approx(simulated_bubble(lifo, 2, 1, 4))  # its op lists played out
    assert peak_activations(cfg, 2, 0, "cpu")[1] == 4  # every micro batch in flight before the first backward
    assert chunk_held_bytes(cfg, 0, "cpu")[0] > 0  # B leaves W its inputs: the planner read split_backward
    assert lifo.name in {p.cfg.parallel.pipeline_schedule for p in schedule_plans(plan)}
    model = build_model(cfg, torch.device("cpu"), ParallelContext(), 0)
    assert any(isinstance(module, RecomputedLayerNorm) for module in model.modules())  # the split backward applied
    report = check_pipeline(lifo.name, 4, 1, 5)
    assert report.ok and report.messages > 0, report.text()


def _train_both(rank: int, world_size: int) -> list:
    register(LIFO)  # a spawned rank registers it as the test did
    return [train_and_gather(cfg, cpu_topology(rank, world_size, cfg), steps=2)
            for cfg in (_config("1f1b"), _config(LIFO.name))]


def test_a_registered_schedule_trains_as_1f1b_does():
    """The same steps in another order: the same losses (known on the head's rank, 1) and gradients."""
    for rank, ((losses, grads), (lifo_losses, lifo_grads)) in enumerate(run_ranks(2, _train_both)):
        if rank == 1:
            assert lifo_losses == pytest.approx(losses, rel=1e-5)
        assert lifo_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(lifo_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _validation_losses(rank: int, world_size: int) -> list[float]:
    from megalite.training.pretrain import pretrain  # the training stack takes seconds to import

    os.environ["WORLD_SIZE"] = str(world_size)
    losses = []
    for schedule in ("1f1b", "zb-v"):
        cfg = _config(schedule, vp=2)
        cfg.train.train_iters, cfg.train.eval_interval, cfg.train.eval_iters = 1, 1, 1
        losses.append(pretrain(cfg).val_loss)
    return losses


def test_evaluation_runs_on_the_schedules_own_stages():
    """Under interleaved 1F1B rank 1 holds the head, under ZB-V rank 0: the same validation loss at either."""
    (loop_0, v_0), (loop_1, v_1) = run_ranks(2, _validation_losses)
    assert math.isnan(loop_0) and math.isnan(v_1)  # known on the head's stage only
    assert math.isfinite(loop_1) and v_0 == pytest.approx(loop_1, rel=1e-5)
