"""tools/gpu_check.py where CI runs it, without a GPU: the dry run builds and validates every command and config
a GPU run would use and prints each step; the steps read what their commands print and write (pytest's
summary, the metrics files, the benchmark's result lines) and judge it; the report is the markdown that goes
into docs/benchmarks.md. The commands themselves are replaced by fakes here: only a GPU runs them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megalite.config import Config
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.planning.plan import GPUS
from tools import gpu_check, gpu_check_report, gpu_check_shape, gpu_check_steps
from tools.gpu_check_report import CheckResult, Goal, format_report
from tools.gpu_check_steps import Context

ROOT = Path(__file__).resolve().parents[1]


# What the GPU machine lacks, of what megalite lists as dependencies (transformers needs none of them): the
# commands run there must import without them.
ABSENT = ("wandb", "datasets", "sentencepiece", "gguf", "accelerate", "google.protobuf")
# `python -c BARE ROOT ABSENT SCRIPT ARGS...` runs `python SCRIPT ARGS...` (or `python -m MODULE ARGS...`) as
# on the GPU machine: the ABSENT modules cannot be found, and megalite only from ROOT on sys.path, not installed
# (an installed copy is ignored). Every finder is wrapped, so that `importlib.util.find_spec` probes (as
# transformers makes) see the modules as missing too.
BARE = """
import os, runpy, sys
root, absent = sys.argv[1], sys.argv[2].split(",")

class Bare:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if any(name == a or name.startswith(a + ".") for a in absent) or not hasattr(self.finder, "find_spec"):
            return None
        spec = self.finder.find_spec(name, path, target)
        return None if name == "megalite" and spec and not (spec.origin or "").startswith(root) else spec

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)

sys.meta_path[:] = [Bare(finder) for finder in sys.meta_path]
sys.argv = sys.argv[3:]
if sys.argv[0] == "-m":
    sys.argv, sys.path[0] = sys.argv[1:], os.getcwd()
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _bare_copy(tmp_path: Path) -> Path:
    """The files a checkout has that gpu_check and its commands read, copied away from this one."""
    copy = tmp_path / "checkout"
    for name in ("megalite", "tools", "tests", "examples"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pretrain_gpt.py", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    return copy


def _run_bare(copy: Path, cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", BARE, str(copy), ",".join(ABSENT), *command], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["wandb", "megalite"])
def test_the_bare_python_lacks_what_the_gpu_machine_lacks(tmp_path, module):
    """The check below means something: wandb is hidden, and an installed megalite is not found."""
    script = tmp_path / "script.py"
    script.write_text(f"import {module}\n")
    done = _run_bare(tmp_path / "checkout", tmp_path, str(script))
    assert done.returncode == 1 and f"ModuleNotFoundError: No module named '{module}'" in done.stderr, done.stderr


def test_dry_run_from_a_bare_copy_prints_every_step_and_writes_nothing(tmp_path):
    """megalite not installed, wandb and datasets absent, run from another directory: the dry run passes."""
    copy, elsewhere = _bare_copy(tmp_path), tmp_path / "elsewhere"
    out, report = tmp_path / "out", tmp_path / "report.md"
    elsewhere.mkdir()
    done = _run_bare(copy, elsewhere, str(copy / "tools" / "gpu_check.py"), "--dry-run", "--out", str(out),
                     "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("[")] == [f"[{s}]" for s in gpu_check.STEPS]
    for expected in ("$ python -m pytest -m cuda tests/test_cuda.py",
                     "$ python -m torch.distributed.run --standalone --nproc_per_node=1 pretrain_gpt.py "
                     "--config examples/gpt2_1.3b.yaml --model.family=gpt2 --data.mock=true",
                     "--config examples/llama_1b.yaml --model.family=llama",
                     "  valid; planner (h100): fits:",
                     "$ python tools/benchmark_throughput.py --device cuda --precision bf16 --family gpt2 --layers 24",
                     "--family llama --layers 16 --hidden 2048 --heads 32 --seq 8192 --vocab 128256 --micro-batch 1 "
                     "--kv-heads 8 --ffn 8192 --rope-theta 500000.0 --tie-embeddings", "--compile --hf-compile",
                     "Llama-3.2-1B: the model of examples/llama_1b.yaml,",
                     "Llama-3.2-1B: micro batch 1, seq 8192; micro batch 2 x seq 8192: HF ~",
                     f"peak allocated in {out / 'train_llama.jsonl'} against the planner's",
                     f"within 420 s (--budget), and writes its report to {report}"):
        assert expected in done.stdout, expected
    assert not out.exists() and not report.exists()


def test_peers_dry_run_from_a_bare_copy_prints_the_wheels_and_every_command(tmp_path):
    """`--peers --dry-run` where the wheels are not: the wheel list, what is missing and how to get it, and each
    peer's command with the model it trains."""
    copy = _bare_copy(tmp_path)
    done = _run_bare(copy, copy, str(copy / "tools" / "gpu_check.py"), "--peers", "--dry-run", "--out",
                     str(tmp_path / "out"), "--wheels", str(tmp_path / "none"))
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("[")] == ["[peers]", "[peers_local]"]
    for expected in ("    megatron-core==0.19.0\n", "    torchtitan==0.2.2 | torchtitan==0.2.1\n",
                     "`bash scripts/gpu_peer_wheels.sh` fetches them", "here: 0 found, missing: megatron-core==0.19.0",
                     "tools/peers/megatron_driver.py --attention sdpa -- --num-layers 24 --hidden-size 2048",
                     "--vocab-size 50303 --make-vocab-size-divisible-by 128", "--bf16 --use-distributed-optimizer",
                     "--num-query-groups 8 --untie-embeddings-and-output-weights",
                     "tools/peers/torchtitan_driver.py --model-args '{\"dim\": 2048, \"n_layers\": 16",
                     "--activation_checkpoint.mode none", "tools/peers/megatron_driver.py --attention local",
                     "GPT-2 1.3B (mb 4 x 2048), torchtitan, fp32 parameters under bf16 autocast:",
                     "Llama-3.2-1B shape, untied (mb 2 x 8192), Megatron-Core (SDPA attention), bf16 parameters"):
        assert expected in done.stdout, expected
    assert "pip install" not in done.stdout  # nothing to install without the wheels


@pytest.mark.parametrize("command", [["pretrain_gpt.py", "--help"], ["tools/benchmark_throughput.py", "--help"],
                                     ["tools/benchmark_attention.py", "--help"],
                                     ["tools/fp8_convergence.py", "--help"],
                                     ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                      "tests/test_cuda.py"], ["tools/peers/megatron_driver.py", "--help"],
                                     ["tools/peers/torchtitan_driver.py", "--help"]])
def test_the_commands_it_runs_import_from_a_bare_copy(tmp_path, command):
    """What gpu_check starts (from the checkout's root) imports there too, without PYTHONPATH."""
    copy = _bare_copy(tmp_path)
    done = _run_bare(copy, copy, *command)
    assert done.returncode == 0, done.stderr


def test_the_configs_it_would_run_validate(tmp_path):
    runs = gpu_check_steps.train_runs(tmp_path, 10)
    assert [run.name for run in runs] == ["gpt2", "llama"]
    for run in runs:
        validate(run.cfg, 1)
        t = run.cfg.train
        assert (t.device, t.precision, t.param_dtype, t.train_iters, t.eval_interval) == ("cuda", "bf16", "bf16", 10,
                                                                                          None)
        assert run.cfg.data.mock and not run.cfg.data.paths and run.cfg.checkpoint.save is None
        assert run.cfg.batch_size(1) == t.micro_batch_size and run.cfg.logging.metrics_file == str(run.metrics)
        script = run.command.index("pretrain_gpt.py")
        assert run.command[script - 1:script + 3] == ["--nproc_per_node=1", "pretrain_gpt.py", "--config",
                                                      gpu_check_steps.SHAPES[run.name][1]]
    gpt2, llama = (run.cfg.model for run in runs)
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.seq_length) == (24, 2048, 2048)
    assert (llama.family, llama.num_layers, llama.kv_heads, llama.vocab_size) == ("llama", 16, 8, 128256)
    benchmarks = gpu_check_steps.benchmark_runs()
    assert [(run.name, run.mode) for run in benchmarks] == [("gpt2", "eager"), ("llama", "eager"),
                                                            ("gpt2", "compiled"), ("llama", "compiled")]
    for run in benchmarks:
        assert run.cfg.model == {"gpt2": gpt2, "llama": llama}[run.name]
        compiled = run.mode == "compiled"
        assert run.cfg.train.compile == compiled and ("--hf-compile" in run.command) == compiled


def _context(tmp_path: Path, runner) -> Context:
    ctx = Context(tmp_path, time.monotonic() + 600, "h100", 989.0, 4, 0.10)
    ctx.run = runner
    return ctx


def _records(losses: list[float], peak_gib: float) -> list[dict]:
    return [{"step": i + 1, "loss": loss, "skipped_steps": 0, "tokens_per_sec": 50_000.0, "peak_memory_gib": peak_gib,
             "peak_memory_kind": "allocated"} for i, loss in enumerate(losses)]


def _fake_training(peaks: dict[str, float], losses: list[float]):
    """Stands in for Context.run of the train step: writes the metrics file its command names."""

    def run(name: str, cmd: list[str], limit: float) -> tuple[int, str]:
        path = Path(next(a for a in cmd if a.startswith("--logging.metrics_file=")).split("=", 1)[1])
        records = _records(losses, peaks[name.removeprefix("train_")])
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0, "done\n"

    return run


def test_train_and_memory_steps_read_the_metrics(tmp_path):
    ctx = _context(tmp_path, _fake_training({"gpt2": 50.0, "llama": 50.6}, [10.9, 9.0, 8.1, 7.5]))
    train = gpu_check_steps.step_train(ctx)
    assert train.status == "PASS", train.summary
    mfu = {run.name: 50_000 * gpu_check_steps.training_flops_per_token(run.cfg.model) / 989e12
           for run in gpu_check_steps.train_runs(tmp_path, 4)}  # 50,000 tokens/s on a 989 TFLOP/s GPU
    assert f"| GPT-2 1.3B | 4 | 10.900 -> 7.500 | 50,000 | {mfu['gpt2']:.1%} | 50.00 |" in train.details
    assert [(g.name, g.measured, g.met) for g in train.goals] == [
        ("GPT-2 1.3B MFU >= 50%", f"{mfu['gpt2']:.1%}", mfu["gpt2"] >= 0.5),
        ("Llama-3.2-1B MFU >= 45%", f"{mfu['llama']:.1%}", mfu["llama"] >= 0.45)]
    memory = gpu_check_steps.step_memory(ctx)
    gpt2 = next(run for run in gpu_check_steps.train_runs(tmp_path, 4) if run.name == "gpt2")
    planned = gpu_check_steps.predicted_gib(gpu_check_steps.make_plan(gpt2.cfg, 1, ctx.gpu))
    assert memory.status == "PASS" and memory.summary.startswith(f"GPT-2 1.3B {50.0 / planned - 1:+.1%} vs the planner")

    ctx.run = _fake_training({"gpt2": 50.0, "llama": 70.0}, [10.9, 11.0, 11.2, 11.3])
    train = gpu_check_steps.step_train(ctx)
    assert train.status == "FAIL" and "the loss did not fall (10.900 -> 11.300)" in train.summary
    assert gpu_check_steps.step_memory(ctx).status == "FAIL"  # Llama 38% above the planner


def test_memory_without_training_runs_is_skipped(tmp_path):
    assert gpu_check_steps.step_memory(_context(tmp_path, None)).status == "SKIP"


@pytest.mark.parametrize("rc, output, status", [
    (0, "...........\n11 passed in 41.20s\n", "PASS"),
    (0, "sssss\nSKIPPED [11] tests/test_cuda.py: needs a CUDA device\n11 skipped in 0.50s\n", "SKIP"),
    (1, "..F\nFAILED tests/test_cuda.py::test_fused_adamw_steps_on_cuda\n1 failed, 10 passed in 40.00s\n", "FAIL"),
    (None, "..", "FAIL"),
])
def test_tests_step_reads_pytest_summary(tmp_path, rc, output, status):
    result = gpu_check_steps.step_tests(_context(tmp_path, lambda name, cmd, limit: (rc, output)))
    assert result.status == status
    assert result.summary == (output.splitlines()[-1] if rc is not None else "timed out")


def _benchmark_output(megalite: float, huggingface: float) -> str:
    """What tools/benchmark_throughput.py prints (its result lines' format)."""
    lines = ["measured matmul peak: 700.000 TFLOP/s (bf16, cuda)"]
    for name, tokens in (("megalite", megalite), ("huggingface", huggingface)):
        lines.append(f"{name:<12} {16384 / tokens * 1e3:8.1f} ms/step {tokens:10.1f} tokens/s  MFU {0.5:6.1%}")
    return "\n".join([*lines, f"megalite / huggingface: {megalite / huggingface:.3f}x"])


def test_attention_step_reads_the_benchmark(tmp_path):
    """The windowed kernel's time and peak against causal flash at each length; SDPA with the window as a mask may
    fail (out of memory at 32k) without failing the step; a windowed kernel that failed fails it."""
    output = ("RESULT causal seq=8192 ms=4.000 peak_gib=0.500\nRESULT window+sinks seq=8192 ms=1.000 peak_gib=0.600\n"
              "RESULT window mask seq=8192 ms=30.000 peak_gib=9.000\nRESULT causal seq=32768 ms=50.000 peak_gib=2.0\n"
              "RESULT window+sinks seq=32768 ms=4.000 peak_gib=4.0\nRESULT window mask seq=32768 failed=OutOfMemory\n")
    result = gpu_check.BY_NAME["attention"].run(_context(tmp_path, lambda name, cmd, limit: (0, output)))
    assert result.status == "PASS" and "window mask seq 32768: OutOfMemory" in result.summary
    assert [(g.name, g.met) for g in result.goals] == [
        ("window+sinks peak memory <= 1.5x causal flash, seq 8192", True), ("window+sinks time <= causal flash, "
                                                                             "seq 8192", True),
        ("window+sinks peak memory <= 1.5x causal flash, seq 32768", False), ("window+sinks time <= causal flash, "
                                                                              "seq 32768", True)]
    failing = output.replace("RESULT window+sinks seq=8192 ms=1.000 peak_gib=0.600", "RESULT window+sinks seq=8192 "
                                                                                      "failed=RuntimeError")
    result = gpu_check.BY_NAME["attention"].run(_context(tmp_path, lambda name, cmd, limit: (0, failing)))
    assert result.status == "FAIL"


def test_throughput_step_sets_the_benchmark_against_the_goals(tmp_path):
    outputs = {"throughput_gpt2_eager": (0, _benchmark_output(50_000, 40_000)),
               "throughput_llama_eager": (0, _benchmark_output(45_000, 30_000)),
               "throughput_gpt2_compiled": (0, _benchmark_output(56_000, 50_000)),
               "throughput_llama_compiled": (None, "compiling...")}
    result = gpu_check_steps.step_throughput(_context(tmp_path, lambda name, cmd, limit: outputs[name]))
    assert result.status == "FAIL" and result.summary == "Llama-3.2-1B compiled: timed out"
    assert "| Llama-3.2-1B | eager | 45,000 |" in "\n".join(result.details)
    flops = gpu_check_steps.flops_by_family(gpu_check_steps.benchmark_runs())
    mfu = {"gpt2": 56_000 * flops["gpt2"] / 989e12, "llama": 45_000 * flops["llama"] / 989e12}
    assert [(g.name, g.measured, g.met) for g in result.goals] == [
        ("GPT-2 1.3B MFU >= 50%", f"{mfu['gpt2']:.1%} (compiled)", mfu["gpt2"] >= 0.5),
        ("GPT-2 1.3B tokens/s >= 1.3x HF eager", "1.25x", False),
        ("GPT-2 1.3B tokens/s >= 1.0x HF compiled", "1.12x", True),
        ("Llama-3.2-1B MFU >= 45%", f"{mfu['llama']:.1%} (eager)", mfu["llama"] >= 0.45),
        ("Llama-3.2-1B tokens/s >= 1.3x HF eager", "1.50x", True),
        ("Llama-3.2-1B tokens/s >= 1.0x HF compiled", "n/a", None)]
    outputs["throughput_llama_compiled"] = (0, _benchmark_output(60_000, 61_000))
    passing = gpu_check_steps.step_throughput(_context(tmp_path, lambda name, cmd, limit: outputs[name]))
    assert passing.status == "PASS" and passing.summary == (
        "GPT-2 1.3B eager: 1.25x HF eager; Llama-3.2-1B eager: 1.50x HF eager; "
        "GPT-2 1.3B compiled: 1.12x HF compiled; Llama-3.2-1B compiled: 0.98x HF compiled")
    failing = gpu_check_steps.step_throughput(_context(tmp_path, lambda name, cmd, limit: (1, "CUDA out of memory")))
    assert failing.status == "FAIL" and failing.summary.startswith("GPT-2 1.3B eager: exit status 1; ")
    assert [g.met for g in failing.goals] == [None] * 6


def test_a_whole_run_with_its_commands_faked(tmp_path, monkeypatch):
    """main on a (pretended) H100: every step runs, the report is written, a failed step makes exit status 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    training = _fake_training({"gpt2": 50.0, "llama": 50.6}, [10.9, 9.0, 8.1, 7.5])
    outputs = {"tests": (0, "11 passed in 41.20s\n"), "throughput_gpt2_eager": (0, _benchmark_output(50_000, 40_000)),
               "throughput_llama_eager": (0, _benchmark_output(45_000, 30_000)),
               "throughput_gpt2_compiled": (0, _benchmark_output(56_000, 50_000)),
               "throughput_llama_compiled": (1, "torch.OutOfMemoryError: CUDA out of memory."),
               "attention": (0, "RESULT causal seq=8192 ms=4.0 peak_gib=0.5\n"
                                "RESULT window+sinks seq=8192 ms=1.0 peak_gib=0.5\n")}

    def run(self, name: str, cmd: list[str], limit: float, path=()) -> tuple[int, str]:
        if name.startswith(("peers_", "profile_", "fusions_")):  # their own tests fake them (test_gpu_check_peers.py,
            # test_gpu_check_fusions.py)
            return 1, "not faked here"
        return training(name, cmd, limit) if name.startswith("train_") else outputs[name]

    monkeypatch.setattr(Context, "run", run)
    report = tmp_path / "report.md"
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--report", str(report), "--train-iters", "4",
                           "--wheels", str(tmp_path / "no_wheels")]) == 1
    text = report.read_text()
    assert text.startswith("## GPU check: NVIDIA H100 80GB HBM3 (H100 SXM; bf16 peak 989.0 TFLOP/s)\n")
    for row in ("| tests | PASS |", "| train | PASS |", "| throughput | FAIL |", "| memory | PASS |",
                "| GPT-2 1.3B tokens/s >= 1.3x HF eager | 1.25x | missed |",
                "| Llama-3.2-1B tokens/s >= 1.0x HF compiled | n/a | not measured |", "torch.OutOfMemoryError"):
        assert row in text, row


def test_report_markdown_from_step_results():
    env = {"command": "`python tools/gpu_check.py`", "device": "NVIDIA H100 80GB HBM3 (H100 SXM; bf16 peak 989.0 "
                                                               "TFLOP/s)", "total time": "312 s"}
    results = [
        CheckResult("tests", "PASS", "11 passed in 41.20s", ["`pytest -m cuda`: 11 passed"], seconds=42.04),
        CheckResult("train", "FAIL", "Llama-3.2-1B: exit status 1", [],
                    [Goal("GPT-2 1.3B MFU >= 50%", "51.2%", True, "pretrain_gpt.py | eager"),
                     Goal("Llama-3.2-1B MFU >= 45%", "n/a", None, "pretrain_gpt.py")], seconds=95.5),
        CheckResult("memory", "SKIP", "no finished training run", ["| model |", "|---|"], seconds=0.01),
    ]
    assert format_report(env, results) == """\
## GPU check: NVIDIA H100 80GB HBM3 (H100 SXM; bf16 peak 989.0 TFLOP/s)

- command: `python tools/gpu_check.py`
- device: NVIDIA H100 80GB HBM3 (H100 SXM; bf16 peak 989.0 TFLOP/s)
- total time: 312 s

| step | result | time | summary |
|---|---|---:|---|
| tests | PASS | 42.0 s | 11 passed in 41.20s |
| train | FAIL | 95.5 s | Llama-3.2-1B: exit status 1 |
| memory | SKIP | 0.0 s | no finished training run |

### Goals

| goal | measured | verdict | from |
|---|---|---|---|
| GPT-2 1.3B MFU >= 50% | 51.2% | met | pretrain_gpt.py \\| eager |
| Llama-3.2-1B MFU >= 45% | n/a | not measured | pretrain_gpt.py |

### tests

`pytest -m cuda`: 11 passed

### memory

| model |
|---|
"""


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_memory_estimate_counts_what_autograd_saves(family):
    """The estimate's activations and saved logits against what a small HF model's forward saves under bf16
    autocast (on a CPU), across its layers and logits."""
    import transformers

    from megalite.checkpoint.hf_config import hf_config
    from megalite.planning.measure import saved_storages

    cfg = Config()
    m = cfg.model
    m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = family, 3, 128, 4, 384
    m.seq_length, m.vocab_size, m.num_query_groups = 64, 1000, 2 if family == "llama" else None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(m), attn_implementation="sdpa").train()
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length))
    with saved_storages(model) as saved, torch.autocast("cpu", torch.bfloat16):
        model(input_ids=tokens, labels=tokens)
    estimate = gpu_check_shape.hf_training_bytes(m, 2, m.seq_length)
    forward = estimate["activations"] + estimate["logits (saved)"] + estimate["weight copies"]
    assert forward == pytest.approx(sum(saved.values()), rel=0.05)
    params = sum(p.numel() for p in model.parameters())
    assert estimate["parameters"] + estimate["gradients"] + estimate["Adam state"] == pytest.approx(16 * params,
                                                                                                     rel=0.01)


def _llama_example() -> Config:
    return parse_config(["--config", str(ROOT / "examples" / "llama_1b.yaml")])


def _megalite_config(mb: int, seq: int) -> Config:
    return gpu_check_steps.benchmark_command(_llama_example(), mb, seq, [])[1]


def test_the_benchmark_shape_is_the_largest_that_fits():
    """Llama-3.2-1B's example shape (2 x 8192 tokens, 128k vocabulary) does not fit HF's side on an H100 but does
    on an H200; on a 40 GB GPU the sequence is halved too."""
    example = _llama_example()
    h100 = gpu_check_shape.choose_shape(example, "h100", _megalite_config)
    assert (h100.micro_batch, h100.seq) == (1, 8192)
    assert h100.why.startswith("micro batch 2 x seq 8192: HF ~") and "fits in 79.6 GiB on h100" in h100.why
    h200 = gpu_check_shape.choose_shape(example, "h200", _megalite_config)
    assert (h200.micro_batch, h200.seq) == (2, 8192) and h200.why.count("micro batch") == 1
    small = gpu_check_shape.choose_shape(example, "a100-40gb", _megalite_config)
    assert (small.micro_batch, small.seq) == (1, 4096) and small.why.endswith("(fits in 39.6 GiB on a100-40gb)")
    for gpu, (micro_batch, seq) in (("h100", (2, 8192)), ("a100-40gb", (1, 8192))):  # the shapes passed over
        too_big = gpu_check_shape.hf_training_bytes(example.model, micro_batch, seq)
        assert sum(too_big.values()) / 2**30 + 3.0 > GPUS[gpu][0] / 1024
    with pytest.raises(ValueError, match="model.family=qwen3: no Hugging Face memory estimate"):
        gpu_check_shape.hf_training_bytes(replace(example.model, family="qwen3"), 1, 8192)


def test_steps_and_commands_that_would_not_fit_the_budget_are_skipped(tmp_path, capsys):
    ctx = _context(tmp_path, None)
    ctx.deadline = time.monotonic() + 100  # room for the eager benchmark runs, not the compiled ones
    outputs = {"throughput_gpt2_eager": (0, _benchmark_output(50_000, 40_000)),
               "throughput_llama_eager": (0, _benchmark_output(45_000, 30_000))}
    ctx.run = lambda name, cmd, limit: outputs[name]
    result = gpu_check_steps.step_throughput(ctx)
    skipped = r"compiled: skipped: needs about 150 s, \d+ s of the time budget \(--budget\) left"
    assert result.status == "PASS" and re.fullmatch(
        rf"GPT-2 1.3B eager: 1.25x HF eager; Llama-3.2-1B eager: 1.50x HF eager; GPT-2 1.3B {skipped}; "
        rf"Llama-3.2-1B {skipped}", result.summary)
    assert "  Llama-3.2-1B compiled skipped: needs about 150 s" in capsys.readouterr().out
    ctx.deadline = time.monotonic() - 1
    skipped = gpu_check.run_step(ctx, "train")
    assert (skipped.status, skipped.summary) == ("SKIP", "skipped: needs about 60 s, 0 s of the time budget "
                                                         "(--budget) left")
    assert gpu_check.run_step(ctx, "memory").status == "SKIP"  # it needs no time: it runs, and finds no metrics
    assert gpu_check_steps.step_train(ctx).status == "SKIP"


def test_the_report_is_written_after_each_step(tmp_path, monkeypatch):
    """A run cut off during a step leaves the report of the steps before it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    report, seen = tmp_path / "out" / "report.md", {}

    def run(self, name: str, cmd: list[str], limit: float) -> tuple[int, str]:
        seen[name] = report.read_text() if report.exists() else None
        return (0, "11 passed in 41.20s\n") if name == "tests" else (1, "killed")

    monkeypatch.setattr(Context, "run", run)
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--only", "tests", "train"]) == 1
    assert seen["tests"] is None and "| tests | PASS |" in seen["train_gpt2"] and "1 of 2 done" in seen["train_gpt2"]
    assert "| train | FAIL |" in report.read_text() and "2 of 2 done" in report.read_text()


def test_commit_is_unknown_without_git_or_its_repository(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check_report, "ROOT", tmp_path)
    assert gpu_check_report.commit() == "unknown (no .git in the checkout)"
    (tmp_path / ".git").mkdir()

    def no_git(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "git")

    monkeypatch.setattr(gpu_check_report.subprocess, "run", no_git)
    assert gpu_check_report.commit() == "unknown (git: No such file or directory)"


def test_without_pytest_the_tests_step_is_skipped(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else find_spec(name, *a))
    result = gpu_check_steps.step_tests(_context(tmp_path, None))
    assert (result.status, result.summary) == ("SKIP", "pytest is not installed here")


def test_commands_import_megalite_from_this_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert gpu_check_steps.child_environment()["PYTHONPATH"] == f"{ROOT}{os.pathsep}/elsewhere"
    monkeypatch.delenv("PYTHONPATH")
    assert gpu_check_steps.child_environment()["PYTHONPATH"] == str(ROOT)


def test_a_budget_that_is_not_positive_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget", "0"])
    assert "--budget 0: give the seconds the run may take, e.g. --budget 420" in capsys.readouterr().err
