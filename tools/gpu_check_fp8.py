"""tools/gpu_check.py's FP8 step: bf16 against each FP8 recipe on the same model (issue 38's GPU figures).

First, in the check's own process, each recipe's CUDA kernels against the exact emulation on the CPU (a dense
linear and four experts with uneven token counts, one without: forward, input gradient, weight gradient; the
kernels round to bf16 where torch's return bf16, so they agree to about 2^-8): the calls CPU CI cannot make
(torch._scaled_mm tensorwise / rowwise / blockwise scales, torch._scaled_grouped_mm with padded experts). Then
tools/fp8_convergence.py trains Llama-3.1-8B's layer cut to 6 layers (`llama3_8b_cut`), compiled, 30 steps in
bf16 and in each recipe from the same seed on the same batches, one run after the other in one process; the step
reads each recipe's metrics file (those a cut-off run finished too): tokens/s, MFU against the bf16 dense peak
(so precisions compare) and the loss gap to bf16. Goals (issue 38): tensorwise >= 1.25x bf16's tokens/s
(torchao's Llama-3-8B figure with FP8 gathers; +10% rowwise), every recipe's last loss within 1% of bf16's.

`smoke=True` runs the same step on this machine's CPU at the tiny shape for 3 steps (tests/test_gpu_check_fp8.py):
everything but the figures.
"""

from __future__ import annotations

import sys

import torch

from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.parallel import gemm
from megalite.parallel.fp8 import RECIPES
from megalite.training.flops import training_flops_per_token
from tools.fp8_convergence import RECIPES as RUNS
from tools.fp8_convergence import SHAPES, gaps, read_curve, run_args
from tools.gpu_check_report import CheckResult, Goal
from tools.gpu_check_steps import Context, display, failed, outcome, percent, tail

STEPS, LIMIT, NEED = 30, 420, 150  # steps per recipe; seconds the command may take, needs to give a figure
SPEEDUP_GOAL, LOSS_GOAL, KERNEL_TOLERANCE = 1.25, 0.01, 2e-2


def fp8_command(out, smoke: bool = False) -> list[str]:
    """tools/fp8_convergence.py at the GPU shape (or, smoke, the tiny one on the CPU), metrics into OUT/fp8/."""
    options = (["--shape", "tiny", "--device", "cpu", "--steps", "3", "--eval-iters", "1"] if smoke else
               ["--shape", "llama3_8b_cut", "--device", "cuda", "--compile", "--steps", str(STEPS),
                "--eval-iters", "2"])
    return [sys.executable, "tools/fp8_convergence.py", *options, "--out", str(out / "fp8")]


def _relative(kernel: torch.Tensor, reference: torch.Tensor) -> float:
    return float((kernel.float().cpu() - reference).norm() / reference.norm().clamp(min=1e-30))


def _matmuls(recipe: gemm.Recipe, device: torch.device, experts: bool) -> list[torch.Tensor]:
    """Output, input gradient and weight gradient of a linear (300 tokens, 256 -> 384) or of four experts (0, 37,
    100 and 163 tokens, 256 -> 256), on `device`, from the same seed."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 256, 256) if experts else (384, 256)
    x, w = torch.randn(300, 256, generator=g), torch.randn(shape, generator=g) * 0.05
    grad = torch.randn(300, shape[-2], generator=g) * 1e-3
    x, w = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    if experts:
        offsets = torch.tensor([0, 37, 137, 300], dtype=torch.int32, device=device)
        y = gemm.grouped_linear(x, w, offsets, recipe)
    else:
        y = gemm.linear(x, w, recipe=recipe)
    y.backward(grad.to(device))
    return [y.detach(), x.grad, w.grad]


def kernel_rows(device: torch.device) -> tuple[list[str], list[str]]:
    """(table rows, problems): each recipe's kernels on `device` against the emulation on the CPU."""
    rows, problems = [], []
    for name, make in RECIPES.items():
        for experts in (False, True):
            errors = [_relative(k, r) for k, r in zip(_matmuls(make(), device, experts),
                                                       _matmuls(make(), torch.device("cpu"), experts))]
            what = "experts" if experts else "dense"
            rows.append(f"| {name} | {what} | " + " | ".join(f"{e:.2e}" for e in errors) + " |")
            if max(errors) > KERNEL_TOLERANCE:
                problems.append(f"{name} {what} kernels differ from the emulation by {max(errors):.1e}")
    return rows, problems


def fp8_dry_run(ctx: Context) -> list[str]:
    """The command, and the config of its bf16 run validated (a bad shape is found before the GPU hour)."""
    cfg = parse_config(run_args("llama3_8b_cut", "none", STEPS, "cuda", True, "bf16", 2, ctx.out / "fp8.jsonl"))
    validate(cfg, 1)
    m = cfg.model
    return [f"$ {display(fp8_command(ctx.out))}",
            f"  {', '.join(RUNS)}: {STEPS} steps each of {m.num_layers} layers, hidden {m.hidden_size}, FFN "
            f"{m.ffn_size}, {m.seq_length} tokens per sample, compiled; kernels against the emulation first"]


def step_fp8(ctx: Context, smoke: bool = False) -> CheckResult:
    device = torch.device("cpu" if smoke else "cuda")
    kernels, problems = kernel_rows(device)
    command = fp8_command(ctx.out, smoke)
    rc, output = ctx.run("fp8", command, LIMIT)
    curves = [c for c in (read_curve(ctx.out / "fp8" / f"{r}.jsonl", r) for r in RUNS) if c and c.losses]
    if rc != 0:
        problems.append(f"tools/fp8_convergence.py: {failed(rc)} ({len(curves)} of {len(RUNS)} runs logged)")
    shape = "tiny" if smoke else "llama3_8b_cut"
    flops = training_flops_per_token(parse_config(SHAPES[shape]).model)
    rows, goals = _training_rows(ctx, curves, flops)
    details = ["Kernels on this device against the emulation (relative error, output / input gradient / weight "
               "gradient):", "", "| recipe | matmul | output | input grad | weight grad |", "|---|---|---:|---:|---:|",
               *kernels, "", f"{display(command)}: {shape}, the same seed and batches; tokens/s the median after 2 "
               f"steps, MFU against {ctx.peak or 'an unknown'} TFLOP/s (bf16 dense peak).", "",
               "| recipe | steps | last loss | gap to bf16 (max / last) | tokens/s | vs bf16 | MFU |",
               "|---|---:|---:|---:|---:|---:|---:|", *rows, *(tail(output) if rc != 0 else [])]
    summary = "; ".join(problems) or "; ".join(f"{g.name}: {g.measured}" for g in goals)
    return CheckResult("fp8", outcome(problems, rows), summary, details, goals)


def _training_rows(ctx: Context, curves: list, flops: float) -> tuple[list[str], list[Goal]]:
    reference = curves[0] if curves and curves[0].recipe == "none" else None
    rows, goals = [], []
    for curve in curves:
        largest, last, _ = gaps(reference, curve) if reference else (None, None, None)
        speed = curve.tokens_per_sec
        ratio = speed / reference.tokens_per_sec if reference and speed and reference.tokens_per_sec else None
        mfu = speed * flops / (ctx.peak * 1e12) if speed and ctx.peak else None
        rows.append(f"| {curve.recipe} | {len(curve.losses)} | {curve.losses[-1]:.4f} | {percent(largest)} / "
                    f"{percent(last)} | {speed or 0:,.0f} | {'n/a' if ratio is None else f'{ratio:.3f}x'} | "
                    f"{percent(mfu)} |")
        if curve.recipe == "none":
            continue
        goals.append(Goal(f"{curve.recipe} loss within {LOSS_GOAL:.0%} of bf16", percent(last),
                          None if last is None else last <= LOSS_GOAL, "last step, same batch"))
        if curve.recipe == "tensorwise":
            goals.append(Goal(f"tensorwise >= {SPEEDUP_GOAL}x bf16 tokens/s",
                              "n/a" if ratio is None else f"{ratio:.3f}x",
                              None if ratio is None else ratio >= SPEEDUP_GOAL, "compiled, one GPU"))
    return rows, goals
