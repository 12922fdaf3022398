"""tools/gpu_check.py's peers and profile steps where CI runs them, without a GPU: the peers' commands train
megalite's model (Megatron's arguments and torchtitan's model args derived from megalite's config), the steps
read what the drivers print and judge it, the profile summary's arithmetic holds, and, where the peers' wheels
are at hand (peer_wheels/, from scripts/gpu_peer_wheels.sh), the drivers train a few steps on a CPU with gloo
and build models of exactly megalite's parameter count. The commands themselves are faked elsewhere: only a GPU
runs them at size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from megalite.planning.parameters import model_parameters
from tools import gpu_check_peers, gpu_check_profile, profile_summary
from tools.gpu_check_peers import megatron_args, peer_runs, torchtitan_model_args
from tools.gpu_check_steps import Context, pretrain_command
from tools.profile_summary import Record, summarize

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("MEGALITE_PEER_WHEELS", ROOT / "peer_wheels"))
TINY = {"gpt2": ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4",
                 "--model.seq_length=16", "--model.vocab_size=100", "--train.micro_batch_size=2"],
        "llama": ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4",
                  "--model.num_query_groups=2", "--model.ffn_hidden_size=96", "--model.seq_length=16",
                  "--model.vocab_size=100", "--train.micro_batch_size=2", "--model.tie_embeddings=false"]}
EXAMPLES = {"gpt2": "examples/gpt2_1.3b.yaml", "llama": "examples/llama_1b.yaml"}


def _tiny(family: str, tmp_path: Path):
    return pretrain_command(EXAMPLES[family], family, tmp_path / "m.jsonl", 3, TINY[family])[1]


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_peer_trains_megalites_model_in_its_regime(tmp_path):
    runs = peer_runs(tmp_path)
    assert [(r.family, r.framework, r.regime) for r in runs] == [
        (family, framework, regime) for family in ("gpt2", "llama") for framework, regime in (
            ("megalite", "bf16"), ("megatron-sdpa", "bf16"), ("megalite", "autocast"), ("torchtitan", "autocast"))]
    for run in runs:
        megalite = next(r for r in runs if (r.family, r.framework, r.regime) == (run.family, "megalite", run.regime))
        if run.framework != "torchtitan":
            assert run.cfg.model == megalite.cfg.model
        assert run.cfg.train.micro_batch_size == {"gpt2": 4, "llama": 2}[run.family]
        if run.framework == "megalite":
            assert run.cfg.train.param_dtype == {"bf16": "bf16", "autocast": "fp32"}[run.regime]
    gpt2, llama = (r.cfg.model for r in runs if r.framework == "megalite" and r.regime == "bf16")
    assert (gpt2.seq_length, llama.seq_length, llama.tied) == (2048, 8192, False)
    titan_gpt2 = next(r for r in runs if r.framework == "torchtitan" and r.family == "gpt2").cfg.model
    assert (titan_gpt2.family, titan_gpt2.hidden_size, titan_gpt2.num_layers, titan_gpt2.seq_length) == (
        "llama", 2048, 24, 2048)  # torchtitan has no GPT-2: its Llama block at GPT-2's shape


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_megatrons_arguments_describe_megalites_model(tmp_path, family):
    cfg = peer_runs(tmp_path)[0 if family == "gpt2" else 4].cfg
    m, args = cfg.model, megatron_args(cfg, 12)
    # NullTokenizer adds one token, then Megatron pads: megalite's padded vocabulary exactly
    vocab, multiple = int(_value(args, "--vocab-size")) + 1, int(_value(args, "--make-vocab-size-divisible-by"))
    assert multiple * math.ceil(vocab / multiple) == m.padded_vocab_size
    assert [int(_value(args, f)) for f in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--seq-length",
                                           "--micro-batch-size", "--global-batch-size", "--train-iters")] == [
        m.num_layers, m.hidden_size, m.ffn_size, m.seq_length, cfg.train.micro_batch_size,
        cfg.train.micro_batch_size, 12]
    assert {"--bf16", "--use-distributed-optimizer", "--no-gradient-accumulation-fusion"} <= set(args)
    llama_flags = {"--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-rope-fusion",
                   "--group-query-attention"}
    assert llama_flags <= set(args) if family == "llama" else not llama_flags & set(args)
    assert _value(args, "--position-embedding-type") == {"gpt2": "learned_absolute", "llama": "rope"}[family]


def test_torchtitans_width_rule_gives_megalites_width(tmp_path):
    """torchtitan's FeedForward: 8/3 of the hidden size, rounded up to a multiple of multiple_of."""
    for run in peer_runs(tmp_path):
        if run.framework == "torchtitan":
            args, m = torchtitan_model_args(run.cfg.model), run.cfg.model
            width = args["multiple_of"] * math.ceil(int(2 * 4 * args["dim"] / 3) / args["multiple_of"])
            assert width == m.ffn_size and args["vocab_size"] == m.padded_vocab_size
    narrow = _tiny("llama", tmp_path).model
    with pytest.raises(ValueError, match="model.ffn_hidden_size=64: torchtitan's Llama cannot be narrower"):
        torchtitan_model_args(type(narrow)(**{**vars(narrow), "ffn_hidden_size": 64}))


def _wheels(folder: Path) -> Path:
    folder.mkdir()
    for choices in gpu_check_peers.wheel_choices():
        name, version = choices[0].split("==")
        (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
    return folder


def _peer_output(seconds: float, tokens: int, parameters: int) -> str:
    steps = "".join(f"peer-step {seconds * (3 if i == 0 else 1):.6f} {tokens} 41.500\n" for i in range(12))
    return f"building...\npeer-model parameters={parameters} vocabulary=50304\n{steps}done\n"


def _fake_peers(tmp_path: Path, failing: set[str] = frozenset()):
    """Context.run for the peers step: megalite's runs write their metrics file, the peers print step lines."""
    calls, runs = [], {r.name: r for r in peer_runs(tmp_path)}

    def run(name: str, cmd: list[str], limit: float, path=()) -> tuple[int | None, str]:
        calls.append((name, list(path)))
        if name == "peers_install" or name in failing:
            return (0, "") if name == "peers_install" else (1, "torch.OutOfMemoryError: CUDA out of memory.")
        peer = runs[name]
        tokens = peer.cfg.train.micro_batch_size * peer.cfg.model.seq_length
        if peer.metrics is not None:
            rate = {"bf16": 50_000.0, "autocast": 45_000.0}[peer.regime]
            peer.metrics.write_text("".join(json.dumps({"step": i + 1, "loss": 10.0, "tokens_per_sec": rate,
                                                        "peak_memory_gib": 40.0}) + "\n" for i in range(12)))
            return 0, "trained\n"
        return 0, _peer_output(tokens / 40_000.0, tokens, model_parameters(peer.cfg.model))

    return run, calls


def test_peers_step_sets_each_peer_against_megalite_in_its_regime(tmp_path):
    ctx = Context(tmp_path, time.monotonic() + 900, "h100", 989.0, 4, 0.10, tmp_path, _wheels(tmp_path / "w"))
    ctx.run, calls = _fake_peers(tmp_path, failing={"peers_llama_torchtitan_autocast"})
    result = gpu_check_peers.run_peers(ctx, "peers", peer_runs(tmp_path), ctx.wheels)
    text = "\n".join(result.details)
    assert result.status == "FAIL" and result.summary == (
        "Llama-3.2-1B shape, untied (mb 2 x 8192), torchtitan (autocast): exit status 1")
    assert "torch.OutOfMemoryError: CUDA out of memory." in text  # the failed run's log, the others measured
    gpt2 = next(r for r in peer_runs(tmp_path) if r.framework == "megatron-sdpa" and r.family == "gpt2")
    mfu = 40_000 * gpu_check_peers.training_flops_per_token(gpt2.cfg.model) / 989e12
    assert (f"| GPT-2 1.3B (mb 4 x 2048) | Megatron-Core (SDPA attention) | bf16 | 40,000 | {mfu:.1%} | 41.50 | "
            f"1.25x | 1.316B |") in text  # megalite's 50,000 tokens/s over Megatron's 40,000, the same model
    assert "| GPT-2 1.3B (mb 4 x 2048) as a Llama block | torchtitan | autocast | 40,000 |" in text
    assert "x (MFU) |" in text  # torchtitan's Llama block at GPT-2's shape is compared by MFU
    assert calls[0] == ("peers_install", []) and all(path == [tmp_path / "peer_site"] for _, path in calls[1:])


def test_peers_without_their_wheels_say_how_to_get_them(tmp_path):
    ctx = Context(tmp_path, time.monotonic() + 900, "h100", 989.0, 4, 0.10, tmp_path, tmp_path / "none")
    ctx.run, calls = _fake_peers(tmp_path)
    result = gpu_check_peers.run_peers(ctx, "peers", peer_runs(tmp_path), ctx.wheels)
    assert result.status == "PASS" and [name for name, _ in calls] == [
        "peers_gpt2_megalite_bf16", "peers_gpt2_megalite_autocast", "peers_llama_megalite_bf16",
        "peers_llama_megalite_autocast"]
    assert "run `bash scripts/gpu_peer_wheels.sh` where a package registry is reachable" in "\n".join(result.details)


def test_profile_summary_of_a_step():
    """Two streams' kernels overlap; the gaps, families, short kernels, launches and syncs are counted."""
    kernels = [("ampere_bf16_s16816gemm_bf16_128x128", 0, 400), ("flash_fwd_kernel", 100, 300),
               ("vectorized_elementwise_kernel<4, GeluFunctor>", 450, 455), ("void at::native::layer_norm", 2000, 2100),
               ("multi_tensor_apply_kernel<AdamFunctor>", 2105, 2300)]
    host = [("cudaLaunchKernel", 0, 5), ("cudaLaunchKernel", 10, 14), ("cudaStreamSynchronize", 500, 1990),
            ("aten::_local_scalar_dense", 495, 1995)]
    records = [Record(n, True, a, b) for n, a, b in kernels] + [Record(n, False, a, b, b - a) for n, a, b in host]
    summary = summarize(records)
    device = summary["device"]
    assert (device["kernels"], device["span_ms"], device["busy_ms"]) == (5, 2.3, (400 + 5 + 100 + 195) / 1e3)
    assert device["gaps"]["over_100us"] == {"count": 1, "ms": 1.545} and device["gaps"]["over_1000us"]["count"] == 1
    assert device["kernels_under_10us"] == {"count": 1, "ms": 0.005}
    assert [f["family"] for f in summary["families"]] == ["matmul", "attention", "optimizer", "norm", "elementwise"]
    assert summary["host"]["launches"] == 2 and [s["name"] for s in summary["host"]["syncs"]] == [
        "aten::_local_scalar_dense", "cudaStreamSynchronize"]


def test_profile_step_reports_each_side_and_drops_traces_too_large_to_come_back(tmp_path, monkeypatch):
    ctx = Context(tmp_path, time.monotonic() + 900, "h100", 989.0, 4, 0.10, tmp_path / "back")
    summary = summarize([Record("sm90_xmma_gemm_bf16", True, 0, 900), Record("triton_poi_fused_add", True, 950, 1000),
                         Record("cudaLaunchKernel", False, 0, 3, 3)], [{"op": "aten::_local_scalar_dense",
                                                                        "site": "megalite/training/step.py(88)",
                                                                        "count": 2}])
    monkeypatch.setattr(gpu_check_profile, "TRACE_LIMIT", 10)

    def run(name: str, cmd: list[str], limit: float, path=()) -> tuple[int, str]:
        out = Path(cmd[cmd.index("--profile-json") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": {}, "sides": {"megalite": summary}}))
        (out.parent / f"trace_{name.removeprefix('profile_')}_megalite.json.gz").write_bytes(b"x" * 11)
        return 0, "done"

    ctx.run = run
    result = gpu_check_profile.step_profile(ctx)
    text = "\n".join(result.details)
    assert result.status == "PASS" and result.summary.startswith("GPT-2 1.3B megalite: device idle 5%, 0 syncs")
    assert "| matmul | 0.90 | 94.7% | 1 |" in text and "| triton | 0.05 | 5.3% | 1 |" in text
    assert "aten::_local_scalar_dense x2 at `megalite/training/step.py(88)`" in text
    assert "trace_gpt2_megalite.json.gz: 0 MiB, removed (too large to come back)" in text
    assert not list((tmp_path / "back").glob("trace_*"))


def _cpu_site(tmp_path: Path) -> Path:
    """The peers' wheels unpacked (pure Python but for Megatron's dataset helpers, which the driver does not use),
    and a module that hides what the GPU machine lacks (wandb, datasets) from them."""
    files, missing = gpu_check_peers.wheel_files(WHEELS)
    if missing:
        pytest.skip(f"the peers' wheels are not in {WHEELS} (bash scripts/gpu_peer_wheels.sh fetches them, or set "
                    f"MEGALITE_PEER_WHEELS): missing {', '.join(missing)}")
    site = tmp_path / "site"
    for file in files:
        with zipfile.ZipFile(file) as wheel:
            wheel.extractall(site)
    (site / "sitecustomize.py").write_text(
        "import sys\n\nclass Hide:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('wandb', 'datasets'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (not on the GPU machine)')\n\n"
        "sys.meta_path.insert(0, Hide())\n")
    return site


def _drive(site: Path, script: str, options: list[str], args: list[str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script, "--cpu",
           *options, "--", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("family, attention", [("gpt2", "sdpa"), ("llama", "local")])
def test_megatron_driver_trains_megalites_model_on_cpu(tmp_path, family, attention):
    site, cfg = _cpu_site(tmp_path), _tiny(family, tmp_path)
    args = [*megatron_args(cfg, 3), "--use-cpu-initialization", "--distributed-backend", "gloo"]
    output = _drive(site, "tools/peers/megatron_driver.py", ["--attention", attention], args)
    steps = gpu_check_peers.parse_peer_steps(output)
    assert [tokens for _, tokens, _ in steps] == [2 * 16] * 3
    assert gpu_check_peers.parse_parameters(output) == model_parameters(cfg.model)


def test_torchtitan_driver_trains_megalites_model_on_cpu(tmp_path):
    site, cfg = _cpu_site(tmp_path), _tiny("llama", tmp_path)
    args = ["--model.name", "megalite_peer", "--model.flavor", "peer", "--training.local_batch_size", "2",
            "--training.seq_len", "16", "--training.steps", "3", "--activation_checkpoint.mode", "none",
            "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", str(tmp_path / "t")]
    output = _drive(site, "tools/peers/torchtitan_driver.py",
                    ["--model-args", json.dumps(torchtitan_model_args(cfg.model))], args)
    assert [tokens for _, tokens, _ in gpu_check_peers.parse_peer_steps(output)] == [2 * 16] * 3
    assert gpu_check_peers.parse_parameters(output) == model_parameters(cfg.model)


def test_the_summaries_records_come_from_torch_profiler_events():
    """records_of and sync_sites_of on a real (CPU) profile: host ops with self time, a sync's Python frame."""
    import torch

    x = torch.randn(64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        (x * 2).sum().item()
    records = profile_summary.records_of(prof.events())
    assert any(r.name == "aten::mul" and not r.on_device and r.self_us is not None for r in records)
    sites = profile_summary.sync_sites_of(prof.events(), roots=("test_gpu_check_peers.py",))
    assert [s["op"] for s in sites] == ["aten::_local_scalar_dense"] and "test_gpu_check_peers.py" in sites[0]["site"]


def test_torchtitans_peak_is_the_steps_though_its_metrics_reset_it_inside_the_step():
    """torchtitan resets the allocator's peak after each log, inside train_step: read after the step it was the
    state held between steps (21.3 GiB for 1.42B parameters on the H200, against 42.2 GiB reserved in its own log).
    The driver keeps the peak each reset is about to lose."""
    from tools.peers.torchtitan_driver import PeakAcrossResets

    allocator = {"peak": 5}  # GiB held between steps: parameters, gradients, Adam's moments

    def reset():
        allocator["peak"] = 5

    peak = PeakAcrossResets(lambda: allocator["peak"])
    reset_in_log = peak.wrap(reset)
    assert peak.take() == 5
    allocator["peak"] = 30  # the step's activations on top
    reset_in_log()  # torchtitan's metrics log, before train_step returns
    assert allocator["peak"] == 5 and peak.take() == 30
    reset_in_log()
    assert peak.take() == 5
