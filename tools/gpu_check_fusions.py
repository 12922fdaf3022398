"""tools/gpu_check.py's fusions step: the eager fixes the H200 profile pointed at, against the eager forms they
replace, in one process per model (tools/benchmark_throughput.py --sides unfused megalite: the same batch, the
same allocator start, one after the other).

  unfused   train.fusions=false: norms as autocast runs them (CUDA: layer_norm in fp32, copies and casts), SwiGLU
            and RoPE as torch's eager kernels under autograd
  megalite  train.fusions=true (the default): norms in their input's dtype, SwiGLU and RoPE one compiled kernel
            each way (model/fused.py)

Each model in the regime of the goal its fixes are for: GPT-2 1.3B with bf16 parameters at its example's micro
batch and sequence (the train step's MFU goal; its norms are LayerNorms), Llama-3.2-1B with fp32 parameters under
autocast at its example's (the throughput step's regime, the goal against Hugging Face; SwiGLU and RoPE). Both
sides split q, k and v as views (model/attention.py split_qkv, no switch): that fix shows in the profile step's
tables and against the H200 figures in docs/benchmarks.md taken before it.
"""

from __future__ import annotations

import sys

from megalite.config_cli import parse_config
from megalite.training.flops import training_flops_per_token
from tools.gpu_check_report import CheckResult
from tools.gpu_check_steps import (
    ROOT,
    SHAPES,
    Context,
    Run,
    benchmark_command,
    display,
    failed,
    outcome,
    parse_benchmark,
    percent,
    tail,
)

REGIMES = {"gpt2": ("bf16 parameters", ["--param-dtype", "bf16"]), "llama": ("fp32 parameters under autocast", [])}
SIDES = ["--sides", "unfused", "megalite"]
LIMIT, NEED = 150, 70  # seconds a run may take; it needs (start-up, two models, compiling the fused kernels)


def fusion_runs() -> list[Run]:
    """The A/B benchmark of each example's model at its own micro batch and sequence (megalite alone fits there)."""
    runs = []
    for family, (_, config) in SHAPES.items():
        example = parse_config(["--config", str(ROOT / config)])
        argv, cfg = benchmark_command(example, example.train.micro_batch_size, example.model.seq_length,
                                      [*REGIMES[family][1], *SIDES])
        runs.append(Run(family, [sys.executable, "tools/benchmark_throughput.py", *argv], cfg, mode="fusions"))
    return runs


def fusions_dry_run(ctx: Context) -> list[str]:
    return [line for run in fusion_runs() for line in (
        f"$ {display(run.command)}", f"  {run.label}: {REGIMES[run.name][0]}, fusions off then on")]


def step_fusions(ctx: Context) -> CheckResult:
    rows, problems, skips, logs, summary = [], [], [], [], []
    runs = fusion_runs()
    for run in runs:
        skipped = ctx.skip(f"{run.label} fusions", NEED)
        if skipped:
            skips.append(f"{run.label}: {skipped}")
            continue
        rc, output = ctx.run(f"fusions_{run.name}", run.command, LIMIT)
        tokens = parse_benchmark(output, ("unfused", "megalite"))
        if rc != 0 or tokens.keys() != {"unfused", "megalite"}:
            problems.append(f"{run.label}: {failed(rc) if rc != 0 else 'no result lines'}")
            logs += ["", f"{run.label}, the end of its output:", *tail(output)]
            continue
        flops = training_flops_per_token(run.cfg.model)
        mfu = {side: t * flops / (ctx.peak * 1e12) if ctx.peak else None for side, t in tokens.items()}
        gain = tokens["megalite"] / tokens["unfused"]
        rows.append(f"| {run.label} | {REGIMES[run.name][0]} | {tokens['unfused']:,.0f} | {percent(mfu['unfused'])} | "
                    f"{tokens['megalite']:,.0f} | {percent(mfu['megalite'])} | {gain:.3f}x |")
        summary.append(f"{run.label} {gain:.2f}x with fusions (MFU {percent(mfu['unfused'])} -> "
                       f"{percent(mfu['megalite'])})")
    details = ["tools/benchmark_throughput.py, megalite alone: train.fusions=false (unfused) then true, one process, "
               f"the same batch; MFU against {ctx.peak or 'an unknown'} TFLOP/s (bf16).", "",
               "| model | regime | unfused tokens/s | MFU | fused tokens/s | MFU | fused / unfused |",
               "|---|---|---:|---:|---:|---:|---:|", *rows, "", "Commands:", "",
               *[f"    {display(run.command)}" for run in runs], *logs]
    return CheckResult("fusions", outcome(problems, rows), "; ".join(problems + summary + skips) or "nothing ran",
                       details)
