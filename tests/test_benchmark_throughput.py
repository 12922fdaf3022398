"""tools/benchmark_throughput.py on a tiny model on CPU: both families build the same network on both sides and
print the result lines tools/gpu_check.py reads. Compiling is left out: it takes a minute on a CPU."""

from __future__ import annotations

import pytest

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
