"""The steps of tools/gpu_check.py: what each runs on the GPU machine and how its figures are judged against the
goals (the command line, the time budget and the report are gpu_check.py's)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from megalite.config import Config
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.planning.plan import GIB, RESERVED_GIB, Plan, make_plan
from megalite.training.flops import training_flops_per_token
from tools.benchmark_throughput import build_config as benchmark_config
from tools.benchmark_throughput import parse_args as benchmark_args
from tools.gpu_check_report import CheckResult, Goal
from tools.gpu_check_shape import Shape, choose_shape

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"gpt2": ("GPT-2 1.3B", "examples/gpt2_1.3b.yaml"), "llama": ("Llama-3.2-1B", "examples/llama_1b.yaml")}
MFU_GOALS = {"gpt2": 0.50, "llama": 0.45}
HF_GOALS = {"eager": 1.3, "compiled": 1.0}  # megalite tokens/s over HF's, in the benchmark mode of that name
WARMUP_STEPS = 2  # logged steps left out of tokens/s and MFU: start-up, allocator warm-up
# The benchmark's modes (both sides eager, both compiled), the eager runs first: they are the cheaper, and the
# ones still to run when the budget is spent are cut. Few steps: an H100 step takes well under a second, while
# start-up, model builds and (compiled) compiling both models take most of a run's time.
BENCHMARK_MODES = {"eager": [], "compiled": ["--compile", "--hf-compile"]}
# untimed: the first step compiles (in compiled mode) and allocates Adam's state, the second runs as timed ones do
BENCHMARK_STEPS = ["--steps", "8", "--warmup", "2"]
LIMITS = {"tests": 150, "train": 150, "eager": 120, "compiled": 240}  # seconds one command may take
# Seconds a command needs at least to produce its figures (start-up, model build, compiling, a few steps): with
# less of the budget left it is skipped, not started to be cut off. A step needs what its cheapest command needs.
NEEDS = {"tests": 45, "train": 60, "eager": 60, "compiled": 150}


@dataclass
class Run:
    """One command of a step and the megalite config it trains, built and validated before anything runs."""

    name: str  # the model family (gpt2, llama)
    command: list[str]
    cfg: Config
    metrics: Path | None = None  # a training run's metrics file
    mode: str | None = None  # a benchmark run's (BENCHMARK_MODES)
    shape: Shape | None = None  # a benchmark run's micro batch and sequence, and why

    @property
    def label(self) -> str:
        return SHAPES[self.name][0]


@dataclass
class Context:
    out: Path
    deadline: float  # time.monotonic() by which every command has ended
    gpu: str  # the planner's name of the device (planning/plan.py GPUS)
    peak: float | None  # bf16 TFLOP/s of the device, None when megalite does not know it
    train_iters: int
    memory_tolerance: float
    artifacts: Path | None = None  # the folder that comes back from the GPU machine: the report's, profiles, logs
    wheels: Path = ROOT / "peer_wheels"  # the peers' wheels (scripts/gpu_peer_wheels.sh)

    def __post_init__(self) -> None:
        self.artifacts = self.artifacts or self.out

    def left(self) -> float:
        """Seconds of the time budget (--budget) left."""
        return self.deadline - time.monotonic()

    def skip(self, what: str, need: float) -> str | None:
        """Why `what`, which needs `need` seconds, is skipped (printed): the budget is short of it; None if it fits."""
        left = self.left()
        if left >= need:
            return None
        reason = f"skipped: needs about {need:.0f} s, {max(left, 0):.0f} s of the time budget (--budget) left"
        print(f"  {what} {reason}", flush=True)
        return reason

    def run(self, name: str, cmd: list[str], limit: float, path: list[Path] = ()) -> tuple[int | None, str]:
        """Run `cmd` from the repository root (`path` first on its PYTHONPATH), its output (stdout and stderr) kept
        in OUT/name.log; the exit status is None when it ran out of time. Then it gets SIGTERM first: torchrun's
        agent passes it on to its workers (which run in sessions of their own) and waits for them; SIGKILL a
        minute later."""
        print(f"  $ {display(cmd)}", flush=True)
        timeout = max(1.0, min(limit, self.left()))
        with subprocess.Popen(cmd, cwd=ROOT, env=child_environment(path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True) as proc:
            try:
                output, rc = proc.communicate(timeout=timeout)[0], proc.returncode
            except subprocess.TimeoutExpired:
                output, rc = self._stop(proc), None
        (self.out / f"{name}.log").write_text(output)
        return rc, output

    @staticmethod
    def _stop(proc: subprocess.Popen) -> str:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.communicate()[0]


def child_environment(first: list[Path] = ()) -> dict[str, str]:
    """This environment with `first` and then the repository root first on PYTHONPATH: every command imports
    megalite from this checkout, installed or not, whichever directory Python puts first on its path (torchrun's
    workers too)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, first), str(ROOT), *([path] if path else [])])}


def display(cmd: list[str]) -> str:
    """A command as a reader would type it in the repository root."""
    return shlex.join("python" if arg == sys.executable else arg.replace(f"{ROOT}/", "") for arg in cmd)


def tail(output: str, lines: int = 30) -> list[str]:
    return ["```", *output.rstrip().splitlines()[-lines:], "```"]


def failed(rc: int | None) -> str:
    return "timed out" if rc is None else f"exit status {rc}"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def pytest_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "tests/test_cuda_kernels.py", "-q",
            "-rs", "-p", "no:cacheprovider"]


def step_tests(ctx: Context) -> CheckResult:
    cmd = pytest_command()
    if importlib.util.find_spec("pytest") is None:
        return CheckResult("tests", "SKIP", "pytest is not installed here", [f"`{display(cmd)}` needs pytest"])
    rc, output = ctx.run("tests", cmd, LIMITS["tests"])
    lines = output.splitlines()
    summaries = [line.strip(" =") for line in lines if re.search(r"\b(passed|failed|skipped|error).* in [\d.]+s", line)]
    summary = summaries[-1] if summaries else failed(rc)
    # exit status 0 without a test passed: every test was skipped, pytest saw no CUDA device
    status = "FAIL" if rc != 0 else "PASS" if " passed" in summary else "SKIP"
    skipped = [f"- {line}" for line in lines if line.startswith("SKIPPED")]
    details = [f"`{display(cmd)}`: {summary}", *([""] + skipped if skipped else [])]
    return CheckResult("tests", status, summary, details + (tail(output) if status == "FAIL" else []))


def pretrain_command(config: str, family: str, metrics: Path, iters: int,
                     overrides: list[str] = ()) -> tuple[list[str], Config]:
    """pretrain_gpt.py under torchrun on one GPU: example `config` with mock data, bf16 parameters (unless
    `overrides` say otherwise), one micro batch per step, no checkpoints or evaluation, a metrics line every step;
    and the validated config it trains. Raises ConfigError for an invalid config."""
    argv = ["--config", config, f"--model.family={family}", "--data.mock=true", "--data.paths=null",
            "--train.device=cuda", "--train.precision=bf16", "--train.param_dtype=bf16",
            f"--train.train_iters={iters}", "--train.global_batch_size=null", "--train.eval_interval=null",
            "--optim.warmup_iters=2", "--checkpoint.save=null", "--checkpoint.save_interval=null",
            "--logging.wandb_project=null", "--logging.log_interval=1", "--logging.progress_bar=false",
            f"--logging.metrics_file={metrics}", *overrides]
    cfg = parse_config(["--config", str(ROOT / config), *argv[2:]])  # the commands run in ROOT; this, anywhere
    validate(cfg, 1)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return [*torchrun, "pretrain_gpt.py", *argv], cfg


def train_runs(out: Path, iters: int) -> list[Run]:
    """The train step's runs: each example config as pretrain_command runs it. Raises ConfigError for an invalid
    config."""
    runs = []
    for family, (_, config) in SHAPES.items():
        metrics = out / f"train_{family}.jsonl"
        runs.append(Run(family, *pretrain_command(config, family, metrics, iters), metrics))
    return runs


def read_metrics(path: Path) -> list[dict]:
    """The training-step records of a metrics file (none when there is no file)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if "loss" in r]


def after_warmup(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records[WARMUP_STEPS:] if r.get(key) is not None]
    return statistics.median(values) if values else None


def train_problem(rc: int | None, records: list[dict], iters: int) -> str | None:
    if rc != 0:
        return failed(rc)
    losses = [r["loss"] for r in records]
    if len(losses) != iters:
        return f"{len(losses)} of {iters} steps logged"
    if not all(map(math.isfinite, losses)) or records[-1]["skipped_steps"]:
        return "a loss was not finite or a step was skipped"
    return None if losses[-1] < losses[0] else f"the loss did not fall ({losses[0]:.3f} -> {losses[-1]:.3f})"


def step_train(ctx: Context) -> CheckResult:
    rows, goals, problems, skips, logs, commands = [], [], [], [], [], []
    for run in train_runs(ctx.out, ctx.train_iters):
        run.metrics.unlink(missing_ok=True)  # the metrics writer appends
        commands.append(f"    {display(run.command)}")
        skipped = ctx.skip(run.label, NEEDS["train"])
        if skipped:
            skips.append(f"{run.label}: {skipped}")
            goals.append(Goal(f"{run.label} MFU >= {MFU_GOALS[run.name]:.0%}", "n/a", None, "skipped (time budget)"))
            continue
        rc, output = ctx.run(f"train_{run.name}", run.command, LIMITS["train"])
        records = read_metrics(run.metrics)
        problem = train_problem(rc, records, ctx.train_iters)
        if problem:
            problems.append(f"{run.label}: {problem}")
            logs += ["", f"{run.label}, the end of its output:", *tail(output)]
        tokens, goal = after_warmup(records, "tokens_per_sec"), MFU_GOALS[run.name]
        mfu = tokens * training_flops_per_token(run.cfg.model) / (ctx.peak * 1e12) if tokens and ctx.peak else None
        goals.append(Goal(f"{run.label} MFU >= {goal:.0%}", percent(mfu), None if mfu is None else mfu >= goal,
                          "pretrain_gpt.py, eager, bf16 parameters (train step)"))
        if records:
            peak = max(r["peak_memory_gib"] for r in records)
            rows.append(f"| {run.label} | {len(records)} | {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} | "
                        f"{tokens or 0:,.0f} | {percent(mfu)} | {peak:.2f} |")
    details = ["pretrain_gpt.py under torchrun on one GPU, mock data, bf16 parameters with fp32 main weights, "
               f"{ctx.train_iters} steps of one micro batch each; tokens/s and MFU are medians after the first "
               f"{WARMUP_STEPS} steps, MFU against {ctx.peak or 'an unknown'} TFLOP/s (bf16).", "",
               "| model | steps | loss first -> last | tokens/s | MFU | peak allocated GiB |",
               "|---|---:|---|---:|---:|---:|", *rows, "", "Commands:", "", *commands, *logs]
    summary = "; ".join(problems + skips) or "; ".join(f"{g.name.split(' MFU')[0]} MFU {g.measured}" for g in goals)
    return CheckResult("train", outcome(problems, rows), summary, details, goals)


def outcome(problems: list[str], results: list[str]) -> str:
    """A step's status: FAIL when a command failed, SKIP when none ran (the budget was spent), PASS otherwise."""
    return "FAIL" if problems else "PASS" if results else "SKIP"


def benchmark_shape(example: Config, micro_batch: int, seq: int) -> list[str]:
    """tools/benchmark_throughput.py's arguments for an example's model at this micro batch and sequence on CUDA in
    bf16; the model options the example leaves at their defaults are left to the benchmark's defaults."""
    m = example.model
    argv = ["--device", "cuda", "--precision", "bf16", "--family", m.family, "--layers", str(m.num_layers),
            "--hidden", str(m.hidden_size), "--heads", str(m.num_attention_heads), "--seq", str(seq),
            "--vocab", str(m.vocab), "--micro-batch", str(micro_batch)]
    optional = {"--kv-heads": m.num_query_groups, "--ffn": m.ffn_hidden_size,
                "--rope-theta": m.rope_theta if m.family == "llama" else None}
    argv += [arg for flag, value in optional.items() if value is not None for arg in (flag, str(value))]
    return argv + ([] if m.tie_embeddings is None else ["--tie-embeddings" if m.tie_embeddings else
                                                        "--no-tie-embeddings"])


def benchmark_command(example: Config, micro_batch: int, seq: int, options: list[str]) -> tuple[list[str], Config]:
    """The benchmark's arguments at this shape and the megalite config it builds from them (validated as the
    benchmark validates it)."""
    argv = [*benchmark_shape(example, micro_batch, seq), *BENCHMARK_STEPS, *options]
    return argv, benchmark_config(benchmark_args(argv))


def benchmark_runs(gpu: str = "h100") -> list[Run]:
    """tools/benchmark_throughput.py at each example's model in each mode, all eager runs first, at the largest
    micro batch and sequence up to the example's at which both sides fit `gpu` (tools/gpu_check_shape.py); raises
    ValueError if a model the benchmark builds from its arguments is not its example's."""
    examples = {family: parse_config(["--config", str(ROOT / config)]) for family, (_, config) in SHAPES.items()}
    shapes = {family: choose_shape(example, gpu, lambda mb, seq, ex=example: benchmark_command(ex, mb, seq, [])[1])
              for family, example in examples.items()}
    runs = []
    for mode, options in BENCHMARK_MODES.items():
        for family, example in examples.items():
            shape = shapes[family]
            argv, cfg = benchmark_command(example, shape.micro_batch, shape.seq, options)
            if cfg.model != replace(example.model, seq_length=shape.seq):
                raise ValueError(f"tools/benchmark_throughput.py {' '.join(argv)} builds {cfg.model}, "
                                 f"not the model of {SHAPES[family][1]}")
            runs.append(Run(family, [sys.executable, "tools/benchmark_throughput.py", *argv], cfg, mode=mode,
                            shape=shape))
    return runs


def shape_lines(runs: list[Run]) -> list[str]:
    """Each family's benchmark shape and the estimate it was chosen by."""
    chosen = {run.name: run.shape for run in runs}
    return [f"{SHAPES[family][0]}: micro batch {shape.micro_batch}, seq {shape.seq}; {shape.why}"
            for family, shape in chosen.items()]


def flops_by_family(runs: list[Run]) -> dict[str, float]:
    """Training FLOPs per token of each family's benchmarked model (the same in every mode)."""
    return {run.name: training_flops_per_token(run.cfg.model) for run in runs}


def parse_benchmark(output: str, sides: tuple[str, ...] = ("megalite", "huggingface")) -> dict[str, float]:
    """tokens/s by side from the benchmark's result lines, of `sides` only."""
    found = re.findall(rf"^({'|'.join(sides)})\s+[\d.]+ ms/step\s+([\d.]+) tokens/s", output, re.M)
    return {side: float(tokens) for side, tokens in found}


def throughput_goals(measured: dict[tuple[str, str], dict[str, float]], flops: dict[str, float],
                     peak: float | None) -> list[Goal]:
    """The goals of each family from the benchmark runs that finished (`measured`: tokens/s by side, by family
    and mode): megalite's best MFU, and in each mode megalite's tokens/s over HF's in the same mode."""
    source = "tools/benchmark_throughput.py, fp32 parameters + bf16 autocast (throughput step)"
    goals = []
    for family, (label, _) in SHAPES.items():
        runs = {mode: tokens for (name, mode), tokens in measured.items() if name == family}
        name = f"{label} MFU >= {MFU_GOALS[family]:.0%}"
        if runs:
            best = max(runs, key=lambda mode: runs[mode]["megalite"])
            mfu = runs[best]["megalite"] * flops[family] / (peak * 1e12) if peak else None
            goals.append(Goal(name, f"{percent(mfu)} ({best})", None if mfu is None else mfu >= MFU_GOALS[family],
                              source))
        else:
            goals.append(Goal(name, "n/a", None, "the throughput runs failed"))
        for mode, goal in HF_GOALS.items():
            name = f"{label} tokens/s >= {goal}x HF {mode}"
            if mode in runs:
                ratio = runs[mode]["megalite"] / runs[mode]["huggingface"]
                goals.append(Goal(name, f"{ratio:.2f}x", ratio >= goal, source))
            else:
                goals.append(Goal(name, "n/a", None, f"the {mode} throughput run did not finish"))
    return goals


def step_throughput(ctx: Context) -> CheckResult:
    runs = benchmark_runs(ctx.gpu)
    flops = flops_by_family(runs)
    print(*(f"  {line}" for line in shape_lines(runs)), sep="\n", flush=True)
    rows, problems, skips, logs, measured = [], [], [], [], {}
    for run in runs:
        skipped = ctx.skip(f"{run.label} {run.mode}", NEEDS[run.mode])
        if skipped:
            skips.append(f"{run.label} {run.mode}: {skipped}")
            continue
        rc, output = ctx.run(f"throughput_{run.name}_{run.mode}", run.command, LIMITS[run.mode])
        tokens = parse_benchmark(output)
        if rc != 0 or tokens.keys() != {"megalite", "huggingface"}:
            problems.append(f"{run.label} {run.mode}: {failed(rc) if rc != 0 else 'no result lines'}")
            logs += ["", f"{run.label} {run.mode}, the end of its output:", *tail(output)]
            continue
        measured[run.name, run.mode] = tokens
        mfu = {side: t * flops[run.name] / (ctx.peak * 1e12) if ctx.peak else None for side, t in tokens.items()}
        rows.append(f"| {run.label} | {run.mode} | {tokens['megalite']:,.0f} | {percent(mfu['megalite'])} | "
                    f"{tokens['huggingface']:,.0f} | {percent(mfu['huggingface'])} | "
                    f"{tokens['megalite'] / tokens['huggingface']:.2f}x |")
    shapes = [f"- {label}: the model of `{config}`, {flops[family] / 1e9:.2f} GFLOP/token"
              for family, (label, config) in SHAPES.items()] + [f"- {line}" for line in shape_lines(runs)]
    details = ["Both sides fp32 parameters under bf16 autocast, HF with SDPA attention and fused AdamW; eager: neither "
               "compiled, compiled: megalite's layers (train.compile) and HF's whole model (torch.compile). MFU "
               f"against {ctx.peak or 'an unknown'} TFLOP/s (bf16).", "", *shapes, "",
               "| model | mode | megalite tokens/s | MFU | HF tokens/s | MFU | megalite / HF |",
               "|---|---|---:|---:|---:|---:|---:|", *rows, "", "Commands:", "",
               *[f"    {display(run.command)}" for run in runs], *logs]
    summary = "; ".join(problems) or "; ".join([
        *(f"{SHAPES[family][0]} {mode}: {tokens['megalite'] / tokens['huggingface']:.2f}x HF {mode}"
          for (family, mode), tokens in measured.items()), *skips])
    return CheckResult("throughput", outcome(problems, rows), summary, details,
                       throughput_goals(measured, flops, ctx.peak))


def predicted_gib(plan: Plan) -> float:
    """What the planner expects the allocator to hold at peak: its tensors, without the reserve it adds for
    the CUDA context, NCCL and fragmentation (torch.cuda.max_memory_allocated counts none of those)."""
    return plan.worst.total / GIB


def step_memory(ctx: Context) -> CheckResult:
    rows, off = [], []
    for run in train_runs(ctx.out, ctx.train_iters):
        records, plan = read_metrics(run.metrics), make_plan(run.cfg, 1, ctx.gpu)
        planned = f"{predicted_gib(plan):.2f} | {plan.needed_gib:.2f}"
        if len(records) < ctx.train_iters or records[-1].get("peak_memory_kind") != "allocated":
            rows.append(f"| {run.label} | n/a (no finished CUDA run in {run.metrics.name}) | {planned} | n/a |")
            continue
        measured = max(r["peak_memory_gib"] for r in records)
        off.append((run.label, measured / predicted_gib(plan) - 1))
        rows.append(f"| {run.label} | {measured:.2f} | {planned} | {off[-1][1]:+.1%} |")
    details = [f"The training runs' torch.cuda.max_memory_allocated against the planner (`make_plan(cfg, 1, "
               f"'{ctx.gpu}')`): its tensors, and its total with the {RESERVED_GIB:g} GiB it reserves for the CUDA "
               f"context, NCCL and fragmentation; PASS within {ctx.memory_tolerance:.0%} of the tensors.", "",
               "| model | measured peak GiB | planner tensors GiB | planner total GiB | measured vs tensors |",
               "|---|---:|---:|---:|---:|", *rows]
    if not off:
        return CheckResult("memory", "SKIP", "no finished training run: run the train step first (same --out)",
                           details)
    status = "FAIL" if any(abs(diff) > ctx.memory_tolerance for _, diff in off) else "PASS"
    return CheckResult("memory", status, "; ".join(f"{label} {diff:+.1%} vs the planner" for label, diff in off),
                       details)



