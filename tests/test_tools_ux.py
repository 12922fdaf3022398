"""What the entry points and tools do for a new user before any training: `--help` without torch, the dry run's
fast default, plotting (and a one-line message without matplotlib), the quickstart's installs and messages."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tools import dry_run, plot_metrics, preprocess_data

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


def test_preprocessing_logs_say_how_far_it_is_and_when_it_ends(tmp_path, capsys):
    """In a log (stderr not a terminal), every progress line has the percentage of the inputs read (on-disk
    bytes, whatever the format), the rates, the time elapsed and an ETA."""
    rows = [{"text": " ".join(str(i % 97) for i in range(n, n + 50))} for n in range(200)]
    plain = tmp_path / "a.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), tmp_path / "c.parquet")
    inputs = [plain, tmp_path / "b.jsonl.gz", tmp_path / "c.parquet"]
    total = sum(p.stat().st_size for p in inputs)
    assert preprocess_data.main(["--input", *map(str, inputs), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--workers", "1",
                                 "--log-interval", "1"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("processed ")]
    pattern = (rf"processed ([\d.]+)% of {total / 1e6:,.1f} MB \| [\d,]+ docs, .* tokens/s \| elapsed [\d.]+s "
               r"\| ETA [\d.]+s")
    done = [float(re.fullmatch(pattern, line).group(1)) for line in lines]
    assert len(done) == 3 and done[0] == round(100 * plain.stat().st_size / total, 1) < done[1] < done[2] == 100


def _metrics_file(path: Path, lrs: list[float]) -> Path:
    """What a run logs: training records (MFU n/a on a CPU), and an evaluation every other step."""
    records = []
    for step, lr in enumerate(lrs, 1):
        records.append({"step": step, "loss": 6.0 - step / 10, "lr": lr, "grad_norm": 1.5, "tokens_per_sec": 900.0,
                        "mfu": None})
        if step % 2 == 0:
            records.append({"step": step, "val_loss": 6.1 - step / 10, "val_ppl": 400.0})
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_plot_metrics_draws_every_logged_curve_of_every_run(tmp_path, capsys):
    first = _metrics_file(tmp_path / "lr3e-4" / "metrics.jsonl", [3e-4, 2e-4, 1e-4, 5e-5])
    second = _metrics_file(tmp_path / "lr1e-3" / "metrics.jsonl", [1e-3, 5e-4, 2e-4, 1e-4])
    runs = {"a": plot_metrics.read_series(first), "b": plot_metrics.read_series(second)}
    assert runs["a"]["val_loss"] == ([2, 4], [pytest.approx(5.9), pytest.approx(5.7)]) and "mfu" not in runs["a"]
    output = tmp_path / "curves.png"
    plot_metrics.main([str(first), str(second), "--output", str(output)])
    assert capsys.readouterr().out == f"wrote {output} (loss, lr, grad_norm, tokens_per_sec)\n"  # no MFU: n/a
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        plot_metrics.main([str(first), str(second), "--labels", "only one"])
    assert "--labels gives 1 names for 2 metrics files" in capsys.readouterr().err


_WITHOUT_MATPLOTLIB = "import sys\nsys.modules['matplotlib'] = None  # as if it were not installed\n"


@pytest.mark.parametrize("tool", ["plot_metrics", "plot_rank_grid", "plot_pipeline_trace"])
def test_the_plot_tools_say_in_one_line_how_to_install_matplotlib(tool, tmp_path):
    metrics = _metrics_file(tmp_path / "run" / "metrics.jsonl", [1e-4, 1e-4])
    calls = {"plot_metrics": f"plot_metrics.main([{str(metrics)!r}])",
             "plot_rank_grid": f"plot_rank_grid.main([{str(tmp_path / 'grid.png')!r}])",
             "plot_pipeline_trace": "plot_pipeline_trace.draw({}, {}, 'title', None)"}
    probe = f"{_WITHOUT_MATPLOTLIB}from tools import {tool}\n{calls[tool]}\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and done.stderr == (
        "error: this tool draws with matplotlib, which is not installed: "
        'pip install -e ".[plot]" (or pip install matplotlib)\n'), done.stderr


_PYTHON_STUB = """#!/usr/bin/env bash
echo "python $*" >> "$STUB_LOG"
case "$*" in *"print(torch.cuda.device_count()"*) echo 2 ;; esac
"""
_TORCHRUN_STUB = """#!/usr/bin/env bash
echo "torchrun $*" >> "$STUB_LOG"
mkdir -p runs/quickstart/checkpoints runs/quickstart/wandb/offline-run-1-abc
echo '{"step": 1}' > runs/quickstart/metrics.jsonl
echo 200 > runs/quickstart/checkpoints/latest
"""


def _stub_repo(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The scripts and pyproject.toml in a folder whose .venv's python and torchrun only record what they are
    asked (nothing is installed or trained), and whose assets are there already."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup_env.sh", "quickstart.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    (repo / "scripts" / "get_assets.sh").write_text('echo "get_assets" >> "$STUB_LOG"\n')
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    for name, text in (("python", _PYTHON_STUB), ("torchrun", _TORCHRUN_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return repo, {**os.environ, "STUB_LOG": str(tmp_path / "calls.log")}


def test_the_quickstart_installs_what_training_needs_and_says_what_it_replaces(tmp_path):
    """The quickstart installs megalite with the plot extra only (the tests' extras are test.sh's), says how long
    it takes, and says before removing the previous quickstart run that it does; installs are remembered, so the
    tests' `dev` adds to the quickstart's and a quickstart after the tests installs nothing."""
    repo, env = _stub_repo(tmp_path)
    log = tmp_path / "calls.log"
    (repo / "runs" / "quickstart").mkdir(parents=True)
    (repo / "runs" / "quickstart" / "from_last_time").touch()

    def run(command: str) -> str:
        done = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    out = run("bash scripts/quickstart.sh")
    assert re.match(r"megalite quickstart: about \d+ minutes on a 2-core CPU", out)
    assert "installing megalite with plot into .venv" in out
    assert ("removing the previous quickstart run in runs/quickstart/ (its dataset, checkpoints, metrics and W&B run)"
            in out) and not (repo / "runs" / "quickstart" / "from_last_time").exists()
    assert re.search(r"^quickstart done in \d+m\d\ds:$", out, re.M)
    installs = [line for line in log.read_text().splitlines() if line.startswith("python -m pip install -e")]
    assert installs == ["python -m pip install -e .[plot]"]
    run(". scripts/setup_env.sh dev")
    installs = [line for line in log.read_text().splitlines() if line.startswith("python -m pip install -e")]
    assert installs[1:] == ["python -m pip install -e .[dev,plot]"]
    assert "installing" not in run("bash scripts/quickstart.sh")
