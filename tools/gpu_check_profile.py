"""tools/gpu_check.py's profile step: where megalite's eager step loses its time on this GPU, in one call.

Two runs of tools/benchmark_throughput.py --profile-json (tools/profile_summary.py: kernel families, launch gaps,
host syncs and where they come from), each in the regime of the goal it missed on the first H100 run:
  GPT-2 1.3B    megalite alone, bf16 parameters with fp32 main weights, the example's micro batch and sequence:
                the train step's regime, whose MFU goal (50%) it missed at 46.5%
  Llama-3.2-1B  megalite and Hugging Face, fp32 parameters under bf16 autocast, at the throughput step's shape:
                the regime of the goal megalite missed against HF eager (1.3x; it ran at 1.10x)
Each writes PROFILE_<family>.json and a gzipped chrome trace per side into the folder that comes back with the
report (--artifacts), and the report gets each side's tables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megalite.config_cli import parse_config
from tools.gpu_check_report import CheckResult
from tools.gpu_check_shape import choose_shape
from tools.gpu_check_steps import ROOT, SHAPES, Context, Run, benchmark_command, display, failed, tail

# family: (why this regime, benchmark options)
PROFILES = {
    "gpt2": ("megalite alone, bf16 parameters (the train step's regime: the MFU goal)",
             ["--sides", "megalite", "--param-dtype", "bf16"]),
    "llama": ("megalite and Hugging Face, fp32 parameters under autocast (the throughput step's regime: the HF goal)",
              ["--sides", "megalite", "huggingface"]),
}
PROFILE_STEPS = ["--profile", "20"]  # after the throughput step's timed steps: the 20 costliest ops printed
TRACE_LIMIT = 15 * 2**20  # bytes: a file over 16 MiB does not come back from the GPU machine
LIMIT = {"gpt2": 150, "llama": 210}
NEED = {"gpt2": 60, "llama": 90}
FAMILY_ROWS, KERNEL_ROWS, SYNC_ROWS = 10, 8, 8


def profile_runs(gpu: str, artifacts: Path) -> list[Run]:
    """The profile step's benchmark runs: GPT-2 at its example's shape (megalite alone fits wherever its training
    does), Llama at the shape where HF's side fits `gpu` too (tools/gpu_check_shape.py)."""
    runs = []
    for family, (_, options) in PROFILES.items():
        example = parse_config(["--config", str(ROOT / SHAPES[family][1])])
        mb, seq = example.train.micro_batch_size, example.model.seq_length
        if "huggingface" in options:
            shape = choose_shape(example, gpu, lambda m, s, ex=example: benchmark_command(ex, m, s, [])[1])
            mb, seq = shape.micro_batch, shape.seq
        files = ["--profile-json", str(artifacts / f"profile_{family}.json"), "--profile-trace",
                 str(artifacts / f"trace_{family}.json.gz")]
        argv, cfg = benchmark_command(example, mb, seq, [*options, *PROFILE_STEPS, *files])
        runs.append(Run(family, [sys.executable, "tools/benchmark_throughput.py", *argv], cfg, mode="profile"))
    return runs


def profile_dry_run(ctx: Context) -> list[str]:
    return [line for run in profile_runs(ctx.gpu, ctx.artifacts) for line in (
        f"$ {display(run.command)}", f"  {run.label}: {PROFILES[run.name][0]}")]


def side_lines(side: str, summary: dict) -> list[str]:
    """A side's markdown: the device's time, kernel families, costliest kernels, host syncs and their sites."""
    d, host = summary["device"], summary["host"]
    lines = [f"**{side}**: step {summary['step_ms']:.1f} ms on the host"]
    if d.get("kernels"):
        gaps = d["gaps"]
        lines[0] += (f"; device span {d['span_ms']:.1f} ms, busy {d['busy_ms']:.1f} ms, idle {d['idle_ms']:.1f} ms "
                     f"({d['idle_share']:.1%}); {d['kernels']} kernels, {d['kernels_under_10us']['count']} under 10 us "
                     f"({d['kernels_under_10us']['ms']:.1f} ms); gaps over 100 us: {gaps['over_100us']['count']} "
                     f"({gaps['over_100us']['ms']:.1f} ms), over 1 ms: {gaps['over_1000us']['count']} "
                     f"({gaps['over_1000us']['ms']:.1f} ms); {host['launches']} launches "
                     f"({host['launch_ms']:.1f} ms of host time)")
        lines += ["", "| kernel family | ms | share | kernels |", "|---|---:|---:|---:|",
                  *(f"| {f['family']} | {f['ms']:.2f} | {f['share']:.1%} | {f['kernels']} |"
                    for f in summary["families"][:FAMILY_ROWS]),
                  "", "| costliest kernels | ms | count |", "|---|---:|---:|",
                  *(f"| `{k['name'][:90]}` | {k['ms']:.2f} | {k['count']} |" for k in summary["kernels"][:KERNEL_ROWS])]
    syncs = "; ".join(f"{s['name']} x{s['count']}" for s in host["syncs"]) or "none"
    sites = "; ".join(f"{s['op']} x{s['count']} at `{s['site']}`" for s in summary["sync_sites"][:SYNC_ROWS])
    return [*lines, "", f"Host syncs: {syncs}." + (f" From: {sites}." if sites else "")]


def step_profile(ctx: Context) -> CheckResult:
    rows, problems, skips, details = [], [], [], []
    for run in profile_runs(ctx.gpu, ctx.artifacts):
        skipped = ctx.skip(f"{run.label} profile", NEED[run.name])
        if skipped:
            skips.append(f"{run.label}: {skipped}")
            continue
        path = ctx.artifacts / f"profile_{run.name}.json"
        path.unlink(missing_ok=True)
        rc, output = ctx.run(f"profile_{run.name}", run.command, LIMIT[run.name])
        sides = json.loads(path.read_text())["sides"] if path.is_file() else {}
        for trace in ctx.artifacts.glob(f"trace_{run.name}_*.json.gz"):
            if trace.stat().st_size > TRACE_LIMIT:
                details.append(f"- {trace.name}: {trace.stat().st_size / 2**20:.0f} MiB, removed (too large to "
                               "come back); rerun the command above for it")
                trace.unlink()
        if rc != 0 or not sides:
            problems.append(f"{run.label}: {failed(rc) if rc != 0 else 'no profile written'}")
            details += ["", f"{run.label}, the end of its output:", *tail(output)]
        details += ["", f"#### {run.label}: {PROFILES[run.name][0]}", "", f"`{display(run.command)}`"]
        for side, summary in sides.items():
            details += ["", *side_lines(side, summary)]
            d = summary["device"]
            if d.get("kernels"):
                rows.append(f"{run.label} {side}: device idle {d['idle_share']:.0%}, "
                            f"{sum(s['count'] for s in summary['host']['syncs'])} syncs")
    summary = "; ".join(problems + rows + skips) or "nothing ran"
    status = "FAIL" if problems else "PASS" if rows else "SKIP"
    return CheckResult("profile", status, summary, [f"Files: {display([str(ctx.artifacts)])}/profile_*.json, "
                                                    "trace_*.json.gz (chrome://tracing, Perfetto).", *details])
