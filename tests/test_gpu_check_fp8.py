"""tools/gpu_check.py's FP8 step where CI runs it, without a GPU: in smoke mode the whole step on the CPU (each
recipe's kernels against the emulation, which on the CPU is the emulation itself; tools/fp8_convergence.py at the
tiny shape, run in this process instead of a child), and how it judges a run that failed part way."""

from __future__ import annotations

import time

from tools import fp8_convergence, gpu_check_plan
from tools.gpu_check_fp8 import fp8_command, step_fp8
from tools.gpu_check_steps import Context


def test_the_fp8_step_in_smoke_mode_on_the_cpu(tmp_path):
    """bf16 and the three recipes, 3 steps each, from the same seed: a row per recipe with its loss gap to bf16
    and its tokens/s ratio, the loss goal judged for each recipe and the tensorwise speed goal reported."""
    ctx = Context(tmp_path, time.monotonic() + 600, "h100", None, 3, 0.10)
    commands = []

    def run(name, cmd, limit):
        commands.append(cmd)
        return fp8_convergence.main(cmd[2:]), ""

    ctx.run = run
    result = step_fp8(ctx, smoke=True)
    assert commands == [fp8_command(tmp_path, smoke=True)] and "--shape" in commands[0]
    assert result.status == "PASS", result.summary
    rows = [line for line in result.details if line.startswith("| ")]
    kernels = [row for row in rows if "dense |" in row or "experts |" in row]
    assert len(kernels) == 6 and all(row.endswith("0.00e+00 | 0.00e+00 | 0.00e+00 |") for row in kernels)
    for recipe in ("none", "tensorwise", "rowwise", "blockwise"):
        assert any(row.startswith(f"| {recipe} | 3 | ") for row in rows), recipe
    names = [goal.name for goal in result.goals]
    assert names == ["tensorwise loss within 1% of bf16", "tensorwise >= 1.25x bf16 tokens/s",
                     "rowwise loss within 1% of bf16", "blockwise loss within 1% of bf16"]
    assert all(goal.met for goal in result.goals if "loss" in goal.name)
    assert "fp8" in gpu_check_plan.STEPS


def test_a_run_cut_off_part_way_fails_the_step_with_what_it_logged(tmp_path):
    """The command dies after bf16's run: the step fails naming how many runs logged, and shows bf16's row."""
    ctx = Context(tmp_path, time.monotonic() + 600, "h100", 989.0, 3, 0.10)

    def run(name, cmd, limit):
        fp8_convergence.main([*cmd[2:], "--recipes", "none"])
        return 1, "torch.OutOfMemoryError: CUDA out of memory"

    ctx.run = run
    result = step_fp8(ctx, smoke=True)
    assert result.status == "FAIL"
    assert result.summary == "tools/fp8_convergence.py: exit status 1 (1 of 4 runs logged)"
    assert any(line.startswith("| none | 3 | ") for line in result.details)
    assert "CUDA out of memory" in "\n".join(result.details)
