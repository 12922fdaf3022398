"""Is megalite right and fast on this GPU? One command on a one-GPU machine, under 10 minutes.

    python tools/gpu_check.py --out DIR              # every step; logs, metrics and DIR/report.md in DIR
    python tools/gpu_check.py --only train memory    # some steps (memory reads the train step's metrics)
    python tools/gpu_check.py --peers                # megalite beside Megatron-Core and torchtitan only
    python tools/gpu_check.py --dry-run              # anywhere: every command and config built and validated

It runs from a plain checkout (megalite need not be installed; the commands it starts import it from this
checkout too) with torch, transformers and triton: without wandb, datasets, git or a package registry; the peers
steps install their wheels (bash scripts/gpu_peer_wheels.sh fetches them into peer_wheels/) with pip --target. The
whole run keeps within --budget seconds (default 420, for machines that stop a command at 10 minutes): a
step or command that would not fit in what is left is skipped with a line saying so. The report is rewritten
after each step, so a run cut off from outside still leaves every finished step's figures in it; the profiles,
chrome traces and logs.tar.gz (every command's log and metrics) go to --artifacts (the report's folder).

Steps, ranked (tools/gpu_check_plan.py; each PASS, FAIL or SKIP with its time; --dry-run prints the estimates):
  tests       `pytest -m cuda tests/test_cuda.py tests/test_cuda_kernels.py`: what CPU CI cannot run.
  fusions     benchmark_throughput.py --sides unfused megalite: train.fusions off against on, one process per
              model (tools/gpu_check_fusions.py).
  train       pretrain_gpt.py under torchrun, one GPU, mock data, bf16 parameters: a few steps of the GPT-2 1.3B
              and Llama-3.2-1B examples; losses, tokens/s, MFU and peak memory from the metrics file.
  memory      each training run's peak allocated memory against the planner's prediction.
  fp8         tools/fp8_convergence.py: bf16 against the tensorwise, rowwise and blockwise FP8 recipes on Llama-3.1-8B's
              layer cut to 6 layers, compiled, 30 steps each: tokens/s, MFU (against the bf16 peak) and the loss
              gap; each recipe's CUDA kernels against the CPU emulation first (tools/gpu_check_fp8.py).
  profile     benchmark_throughput.py --profile-json: where megalite's eager step loses its time
              (tools/gpu_check_profile.py).
  throughput  tools/benchmark_throughput.py at the GPT-2 1.3B and Llama-3.2-1B examples' models against Hugging
              Face (SDPA, fused AdamW): eager against eager, then compiled against compiled (megalite's layers
              as train.compile does, HF's whole model as Trainer's torch_compile does); at the examples' micro
              batch and sequence, or smaller where a memory estimate says HF's side would not fit the GPU
              (tools/gpu_check_shape.py).
  peers       megalite beside Megatron-Core (SDPA attention) and torchtitan (tools/gpu_check_peers.py).
  peers_local Megatron-Core with its own unfused attention, GPT-2 1.3B only.
  attention   tools/benchmark_attention.py: a sliding window with sinks (FlashAttention's window) at 8k and 32k
              tokens against causal flash and against SDPA with the window as a mask, time and peak memory.

The markdown report (for docs/benchmarks.md) names the device and the torch/CUDA versions and sets the results
against the goals: MFU >= 50% for GPT-2 1.3B and >= 45% for Llama-3.2-1B (against the device's peak in
megalite/training/flops.py), tokens/s >= 1.3x HF eager and >= 1.0x HF compiled (megalite eager against HF
eager, megalite compiled against HF compiled, each model family on its own). Exit status 1 when a step
failed (a missed goal is reported, not failed), 2 without a CUDA device or with an invalid config. Each
command's output is kept in --out as NAME.log.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, Python puts tools/ on the path, not the repository root
from megalite.config import ConfigError  # noqa: E402
from megalite.planning.plan import GPUS  # noqa: E402
from megalite.training.flops import device_model, peak_tflops  # noqa: E402
from tools.gpu_check_peers import peer_runs  # noqa: E402
from tools.gpu_check_plan import BY_NAME, STEPS  # noqa: E402
from tools.gpu_check_profile import profile_runs  # noqa: E402
from tools.gpu_check_report import CheckResult, environment, write_report  # noqa: E402
from tools.gpu_check_steps import Context, benchmark_runs, display, tail, train_runs  # noqa: E402

KEEP_LOGS = "logs.tar.gz"  # every command's log and metrics file, packed into --artifacts after each step


def run_step(ctx: Context, name: str) -> CheckResult:
    """One step, timed; an error inside it fails the step, and the other steps still run."""
    print(f"[{name}]", flush=True)
    start = time.monotonic()
    skipped = ctx.skip(f"[{name}]", BY_NAME[name].need)
    if skipped:
        result = CheckResult(name, "SKIP", skipped)
    else:
        try:
            result = BY_NAME[name].run(ctx)
        except Exception as error:  # noqa: BLE001 - reported in the step's row
            result = CheckResult(name, "FAIL", f"{type(error).__name__}: {error}", tail(traceback.format_exc(), 40))
    result.seconds = time.monotonic() - start
    print(f"[{name}] {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
    return result


def pack_logs(out: Path, artifacts: Path) -> None:
    """OUT's logs and metrics files as one archive in the artifacts folder (a machine that returns few files
    returns them all this way)."""
    artifacts.mkdir(parents=True, exist_ok=True)
    with tarfile.open(artifacts / KEEP_LOGS, "w:gz") as tar:
        for path in sorted([*out.glob("*.log"), *out.glob("*.jsonl")]):
            tar.add(path, arcname=path.name)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="build, validate and print everything; run nothing")
    p.add_argument("--only", nargs="+", choices=STEPS, help="run these steps only (in the usual order)")
    p.add_argument("--peers", action="store_true", help="the peers steps only (--only peers peers_local)")
    p.add_argument("--wheels", type=Path, default=ROOT / "peer_wheels",
                   help="the peers' wheels (bash scripts/gpu_peer_wheels.sh downloads them there)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="where the profiles, traces and logs.tar.gz go (default: the report's folder)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="metrics files, logs, the report")
    p.add_argument("--report", type=Path, default=None,
                   help="the markdown report, rewritten after each step (default: OUT/report.md)")
    p.add_argument("--train-iters", type=int, default=10, help="steps of each training run")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds the whole run may take; what would not fit in what is left is skipped (a command "
                        "that runs over has a minute more to stop)")
    p.add_argument("--memory-tolerance", type=float, default=0.10, help="allowed |measured / planned - 1|")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak for MFU when flops.py lacks this GPU")
    args = p.parse_args(argv)
    if args.budget <= 0:
        p.error(f"--budget {args.budget:g}: give the seconds the run may take, e.g. --budget 420")
    if args.peers:
        args.only = [*(args.only or []), "peers", "peers_local"]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    report = (args.report or args.out / "report.md").resolve()
    steps = [s for s in STEPS if s in (args.only or STEPS)]
    if not args.dry_run and not torch.cuda.is_available():
        print("error: torch sees no CUDA device; run on a GPU machine, or see the plan with --dry-run", file=sys.stderr)
        return 2
    gpu, peak = "h100", args.peak_tflops  # the planner's device in a dry run, and for a GPU it does not know
    if torch.cuda.is_available():
        model = device_model(torch.cuda.get_device_name(0))
        gpu = next((key for key, (_, row) in GPUS.items() if row == model), gpu)
        peak = peak_tflops(torch.device("cuda", 0), "bf16", args.peak_tflops)
    out, start = args.out.resolve(), time.monotonic()
    artifacts = (args.artifacts or report.parent).resolve()
    ctx = Context(out, start + args.budget, gpu, peak, args.train_iters, args.memory_tolerance, artifacts,
                  args.wheels.resolve())
    try:
        if args.dry_run:
            print("dry run: nothing runs on a GPU. A real run takes these steps, in order (estimates: one H200):")
            for step in (BY_NAME[name] for name in steps):
                print(f"\n[{step.name}]", f"~{step.estimate:.0f} s: {step.about}", *step.dry_run(ctx), sep="\n  ")
            print(f"\nthese steps take ~{sum(BY_NAME[name].estimate for name in steps):.0f} s on one H200 in all")
            print(f"within {args.budget:.0f} s (--budget), and writes its report to {display([str(report)])}")
            return 0
        train_runs(out, args.train_iters)  # every config is valid before any GPU work starts
        benchmark_runs(gpu)
        peer_runs(out)
        profile_runs(gpu, artifacts)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    env = environment(display([sys.executable, "tools/gpu_check.py", *argv]), peak)
    results = []
    for step in steps:  # the report after each step: a run stopped from outside keeps what it finished
        results.append(run_step(ctx, step))
        write_report(report, env | {"total time": f"{time.monotonic() - start:.0f} s of {args.budget:.0f} s",
                                    "steps": f"{len(results)} of {len(steps)} done"}, results)
        pack_logs(out, artifacts)
    print(f"report written to {report}")
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
