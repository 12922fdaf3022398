"""The planner's Muon step (planning/muon.py) against what a rank holds during it, measured by the dry run.

On a tiny model the Muon update on the owner ranks (whole matrices, Newton-Schulz temporaries, the exchange) is
the step's peak, several times the planned optimizer state: the simulated rank's measured peak must match the
planner's total within 2% (the dry run's own tolerance is 5%), and without the Muon term it would not.
"""

from __future__ import annotations

import pytest

from megalite.dryrun.report import TOLERANCE, difference, format_dry_run
from megalite.dryrun.run import dry_run
from megalite.planning.measure import measurement_config
from megalite.planning.muon import stage_steps
from megalite.planning.plan import format_plan, make_plan

MODEL = {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32, "vocab_size": 256}


def _cfg(precision: str, tp: int, dp: int, zero: int):
    return measurement_config(tp * dp, model=MODEL, optim={"optimizer": "muon"},
                              parallel={"tp": tp, "sequence_parallel": tp > 1, "distributed_optimizer": zero >= 1},
                              train={"micro_batch_size": 2, "global_batch_size": 2 * dp, "precision": precision,
                                     "param_dtype": precision})


@pytest.mark.parametrize("layout", [("fp32", 2, 2, 1), ("bf16", 2, 1, 0)], ids=["fp32-tp2-dp2-dist", "bf16-tp2"])
def test_the_planned_muon_step_is_the_measured_peak(layout):
    cfg = _cfg(*layout)
    report = dry_run(cfg, layout[1] * layout[2], 1)
    run = report.ranks[0]
    stage = report.plan(run)
    muon = max(step.peak for step in stage.muon)
    assert muon > 2 * stage.optimizer  # the update's own memory dominates this model's state
    assert abs(difference(run, stage)) <= 0.02 <= TOLERANCE, format_dry_run(report)
    assert (run.total - (stage.total - muon)) / run.total > 0.2  # the peak is the Muon step's
    assert f"Muon's update as planned for this rank: {muon / 2**30:.3f} G" in format_dry_run(report)
    text = format_plan(make_plan(cfg, layout[1] * layout[2]))
    assert f"at most {muon / 2**30:.2f} GiB held during the optimizer step" in text and "Newton-Schulz" in text


def test_newton_schulz_flops_are_the_same_whatever_the_layout():
    """Each matrix is orthogonalised once, on one owner: the stage's FLOPs are one device's."""
    one = sum(step.flops for step in stage_steps(_cfg("fp32", 1, 1, 0), 1, 0))
    split = stage_steps(_cfg("fp32", 2, 2, 1), 4, 0)
    assert one > 0 and sum(step.flops for step in split) == one
    assert len(split) == 4 and all(step.flops for step in split)  # the work spreads over the stage
