"""tools/benchmark_throughput.py on a tiny model on CPU: both families build the same network on both sides and
print the result lines tools/gpu_check.py reads. Compiling is left out: it takes a minute on a CPU."""

from __future__ import annotations

import re

import pytest
import torch

from megalite.checkpoint.hf_config import hf_config
from tools import benchmark_throughput as bench
from tools.gpu_check_steps import parse_benchmark

TINY = ["--layers", "1", "--hidden", "64", "--heads", "4", "--seq", "16", "--micro-batch", "2", "--vocab", "300",
        "--precision", "fp32", "--steps", "1", "--warmup", "1", "--device", "cpu"]


def test_llama_options_build_the_model_on_both_sides():
    args = bench.parse_args([*TINY, "--family", "llama", "--kv-heads", "2", "--ffn", "96", "--tie-embeddings",
                             "--rope-theta", "500000", "--hf-compile"])
    m = bench.build_config(args).model
    assert (m.family, m.kv_heads, m.ffn_size, m.tied, m.rope_theta) == ("llama", 2, 96, True, 500000.0)
    assert args.hf_compile and not args.compile
    hf = hf_config(m)
    assert (hf.num_key_value_heads, hf.intermediate_size, hf.tie_word_embeddings) == (2, 96, True)


@pytest.mark.parametrize("option", [["--kv-heads", "2"], ["--rope-theta", "500000"]])
def test_gpt2_refuses_llama_only_options(option):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, *option])


@pytest.mark.parametrize("family", [["--family", "gpt2"], ["--family", "llama", "--kv-heads", "2"]])
def test_a_tiny_run_prints_both_sides(family, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_peak_tflops", lambda device, dtype: 1.0)  # the real one takes seconds
    bench.main([*TINY, *family])
    out = capsys.readouterr().out
    assert parse_benchmark(out).keys() == {"megalite", "huggingface"}
    assert f"model {family[1]} L=1 h=64" in out and "HF attention sdpa" in out


def test_profile_prints_each_sides_top_ops_and_matmul_share(monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_peak_tflops", lambda device, dtype: 1.0)
    bench.main([*TINY, "--family", "qwen3", "--experts", "4", "--topk", "2", "--expert-ffn", "32", "--profile", "5"])
    out = capsys.readouterr().out
    assert parse_benchmark(out).keys() == {"megalite", "huggingface"}
    for side in ("megalite", "huggingface"):
        assert f"{side} profile of one step:" in out
        line = next(line for line in out.splitlines() if line.startswith(f"{side} matmuls: "))
        matmul, total = (float(word) for word in line.split() if word.replace(".", "").isdigit())
        assert 0 < matmul < total


def test_plain_runs_megalites_model_in_a_bare_loop_as_a_third_side(monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_peak_tflops", lambda device, dtype: 1.0)
    bench.main([*TINY, "--plain"])
    out = capsys.readouterr().out
    assert parse_benchmark(out).keys() == {"megalite", "huggingface"}  # what gpu_check reads is unchanged
    assert re.search(r"^plain\s+[\d.]+ ms/step\s+[\d.]+ tokens/s", out, re.M)
    assert re.search(r"^megalite / plain: [\d.]+x$", out, re.M)


def test_the_plain_loop_trains_the_same_model_as_megalites_step():
    """Its first loss is megalite's: the same network, weights and batch, so the gap is the step's host work."""
    args = bench.parse_args(TINY)
    cfg = bench.build_config(args)
    topology = bench.Topology.from_environment("cpu", cfg.parallel)
    batch = bench.mock_batches(cfg, 1)[0]
    with bench.build_trainer(cfg, topology) as trainer:
        expected = bench.train_step(trainer, [batch]).figures[0]
    losses, backward = [], torch.Tensor.backward
    with bench.plain_step(cfg, topology, batch) as step, pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "backward", lambda loss: (losses.append(loss.detach()), backward(loss)))
        step()
    torch.testing.assert_close(losses[0].double(), expected.reshape(()), rtol=1e-6, atol=0)


def test_unfused_is_megalite_without_its_fusions_as_another_side(monkeypatch, capsys):
    """The fusions step's A/B in one process (tools/gpu_check_fusions.py): the same model, train.fusions off."""
    monkeypatch.setattr(bench, "measure_peak_tflops", lambda device, dtype: 1.0)
    built, step = [], bench.megalite_step

    def megalite_step(cfg, *rest):
        built.append(cfg.train.fusions)
        return step(cfg, *rest)

    monkeypatch.setattr(bench, "megalite_step", megalite_step)
    bench.main([*TINY, "--family", "llama", "--kv-heads", "2", "--sides", "unfused", "megalite"])
    out = capsys.readouterr().out
    assert parse_benchmark(out, ("unfused", "megalite")).keys() == {"unfused", "megalite"} and built == [False, True]
    assert re.search(r"^megalite / unfused: [\d.]+x$", out, re.M)
