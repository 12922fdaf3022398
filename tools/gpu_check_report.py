"""tools/gpu_check.py's report: what each step found, the machine it ran on, and the markdown (for
docs/benchmarks.md) made of them. Kept apart from the steps so that the format can be read, and tested,
without the commands that produce the figures."""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch
import transformers

from megalite.training.flops import device_model

ROOT = Path(__file__).resolve().parents[1]
VERDICTS = {True: "met", False: "missed", None: "not measured"}


@dataclass
class Goal:
    name: str
    measured: str
    met: bool | None  # None: not measured
    source: str


@dataclass
class CheckResult:
    """What one step of the GPU check (tests, train, throughput or memory) found."""

    name: str
    status: str  # PASS, FAIL or SKIP
    summary: str
    details: list[str] = field(default_factory=list)  # markdown lines of the step's section of the report
    goals: list[Goal] = field(default_factory=list)
    seconds: float = 0.0


def environment(command: str, peak: float | None) -> dict[str, str]:
    """The machine and the software, for the report (`command`: the GPU check's command line as a reader types it,
    `peak`: the bf16 TFLOP/s MFU is taken against)."""
    env = {"command": f"`{command}`", "date": date.today().isoformat()}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        model = device_model(name) or "not in megalite/training/flops.py"
        env["device"] = f"{name} ({model}; bf16 peak {peak or 'unknown'} TFLOP/s)"
        env["software"] = (f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
                           f"{torch.backends.cudnn.version()}, transformers {transformers.__version__}, "
                           f"Python {platform.python_version()}")
    return env | {"commit": commit()}


def commit() -> str:
    """The checkout's commit, or why it is unknown: a copy of the tree without .git (which git would otherwise
    describe from a repository around it), or a machine without git."""
    if not (ROOT / ".git").exists():
        return "unknown (no .git in the checkout)"
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    except OSError as error:
        return f"unknown (git: {error.strerror})"
    return git.stdout.strip() or f"unknown (git describe: {git.stderr.strip() or f'exit status {git.returncode}'})"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def format_report(env: dict[str, str], results: list[CheckResult]) -> str:
    """The markdown report: the environment, one row per step, the goals, then each step's details."""
    lines = [f"## GPU check: {env.get('device', 'no CUDA device')}", "", *(f"- {k}: {v}" for k, v in env.items())]
    lines += ["", "| step | result | time | summary |", "|---|---|---:|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} s | {cell(r.summary)} |" for r in results]
    goals = [g for r in results for g in r.goals]
    if goals:
        lines += ["", "### Goals", "", "| goal | measured | verdict | from |", "|---|---|---|---|"]
        lines += [f"| {g.name} | {g.measured} | {VERDICTS[g.met]} | {cell(g.source)} |" for g in goals]
    for r in results:
        lines += ["", f"### {r.name}", "", *r.details] if r.details else []
    return "\n".join(lines) + "\n"


def write_report(path: Path, env: dict[str, str], results: list[CheckResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_report(env, results))
