"""tools/gpu_check.py's fusions step where CI runs it, without a GPU: the A/B commands it would run (megalite with
train.fusions off, then on, one process per model, each in its goal's regime) and how it reads and judges their
output (the benchmark's own side is tested in tests/test_benchmark_throughput.py)."""

from __future__ import annotations

import time

from tools import gpu_check_plan
from tools.gpu_check_fusions import fusion_runs, fusions_dry_run, step_fusions
from tools.gpu_check_steps import Context


def _output(unfused: float, fused: float) -> str:
    lines = [f"{name:<12} {16384 / tokens * 1e3:8.1f} ms/step {tokens:10.1f} tokens/s  MFU {0.5:6.1%}"
             for name, tokens in (("unfused", unfused), ("megalite", fused))]
    return "\n".join([*lines, f"megalite / unfused: {fused / unfused:.3f}x"])


def test_the_runs_set_fusions_off_against_on_in_each_models_goal_regime(tmp_path):
    runs = {run.name: run for run in fusion_runs()}
    assert runs["gpt2"].cfg.train.param_dtype == "bf16" and runs["llama"].cfg.train.param_dtype == "fp32"
    assert (runs["gpt2"].cfg.train.micro_batch_size, runs["llama"].cfg.model.seq_length) == (8, 8192)
    for run in runs.values():
        assert run.command[-3:] == ["--sides", "unfused", "megalite"] and run.cfg.train.fusions
    ctx = Context(tmp_path, time.monotonic() + 600, "h100", 989.0, 4, 0.10)
    lines = fusions_dry_run(ctx)
    assert lines[1] == "  GPT-2 1.3B: bf16 parameters, fusions off then on"
    assert gpu_check_plan.STEPS[:4] == ("tests", "fusions", "train", "memory")


def test_the_step_reports_each_models_gain_and_a_failed_run_with_its_log(tmp_path):
    outputs = {"fusions_gpt2": (0, _output(50_000.0, 55_000.0)), "fusions_llama": (1, "CUDA out of memory")}
    ctx = Context(tmp_path, time.monotonic() + 600, "h100", 989.0, 4, 0.10)
    ctx.run = lambda name, cmd, limit: outputs[name]
    result = step_fusions(ctx)
    assert result.status == "FAIL" and result.summary.startswith(
        "Llama-3.2-1B: exit status 1; GPT-2 1.3B 1.10x with fusions (MFU ")
    assert any(row.startswith("| GPT-2 1.3B | bf16 parameters | 50,000 | ") and row.endswith(" | 1.100x |")
               for row in result.details)
    assert "CUDA out of memory" in "\n".join(result.details)
    outputs["fusions_llama"] = (0, _output(40_000.0, 46_000.0))
    assert step_fusions(ctx).status == "PASS"
