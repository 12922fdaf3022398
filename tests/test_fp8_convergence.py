"""tools/fp8_convergence.py: the loss gaps it reports (relative to bf16 at the same step, largest and last, and the
validation loss's), its table, and a run of a few steps of the tiny model (bf16 and one recipe)."""

from __future__ import annotations

import pytest

from tools import fp8_convergence
from tools.fp8_convergence import Curve, gaps, read_curve, table


def test_gaps_and_table():
    bf16 = Curve("none", [4.0, 3.0, 2.0], 2.5, 1000.0)
    fp8 = Curve("blockwise", [4.0, 3.06, 2.01], 2.52, 1500.0)
    largest, last, val = gaps(bf16, fp8)
    assert (largest, last, val) == pytest.approx((0.02, 0.005, 0.008))
    rows = table([bf16, fp8])
    assert rows[2] == "| bf16 (none) | 3 | 2.0000 | 2.5000 | 0.00% | 0.00% | 0.00% | 1,000 |"
    assert rows[3] == "| blockwise | 3 | 2.0100 | 2.5200 | 2.00% | 0.50% | 0.80% | 1,500 |"
    with pytest.raises(ValueError, match="blockwise: no step of its run to compare with none's"):
        gaps(bf16, Curve("blockwise", [], None, None))


def test_a_few_steps_of_bf16_and_rowwise(tmp_path, capsys):
    assert fp8_convergence.main(["--steps", "2", "--recipes", "none", "rowwise", "--eval-iters", "1",
                                 "--out", str(tmp_path)]) == 0
    curves = [read_curve(tmp_path / f"{recipe}.jsonl", recipe) for recipe in ("none", "rowwise")]
    assert [len(c.losses) for c in curves] == [2, 2] and all(c.val_loss for c in curves)
    assert curves[0].losses[0] == pytest.approx(curves[1].losses[0], rel=1e-2)  # same init and batch
    assert curves[0].losses != curves[1].losses  # FP8 ran
    out = capsys.readouterr().out
    assert "FP8 against none: tiny, 2 steps, bf16, cpu" in out and "\n| rowwise | 2 | " in out
    with pytest.raises(SystemExit):
        fp8_convergence.main(["--steps", "0"])
