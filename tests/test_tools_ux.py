"""What the entry points and tools do for a new user before any training: `--help` without torch, the dry run's
fast default, plotting (and a one-line message without matplotlib), the quickstart's installs and messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools import dry_run

ROOT = Path(__file__).resolve().parents[1]


def test_help_imports_no_torch():
    """The import of torch takes seconds; the field list needs none of it."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['pretrain_gpt.py', '--help']\n"
             "try:\n    runpy.run_path('pretrain_gpt.py', run_name='__main__')\n"
             "except SystemExit as done:\n    assert done.code == 0, done.code\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pretrain_gpt.py") and "--model.ffn_hidden_size" in done.stdout
    assert done.stderr.strip().endswith("no torch")


def test_the_dry_runs_default_is_the_fast_peak():
    args, _ = dry_run.parse_args(["--config", "examples/llama_70b.yaml", "--world-size", "64"])
    assert args.microbatches == "peak"
