"""What the entry points and tools do for a new user before any training: `--help` without torch, the dry run's
fast default, plotting (and a one-line message without matplotlib), the quickstart's installs and messages."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tools import dry_run, preprocess_data

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
