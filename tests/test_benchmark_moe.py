"""tools/benchmark_moe.py runs both implementations of the experts on the same layer and prints their table."""

from __future__ import annotations

import torch

from megalite.parallel.gemm import grouped_linear
from tools import benchmark_moe


def test_the_loop_reference_equals_the_grouped_gemm():
    counts = torch.tensor([3, 0, 2])
    x, w = torch.randn(5, 8), torch.randn(3, 4, 8)
    offsets = counts.cumsum(0).to(torch.int32)
    torch.testing.assert_close(grouped_linear(x, w, offsets, benchmark_moe.ExpertLoop()),
                               grouped_linear(x, w, offsets))


def test_the_benchmark_prints_both_rows(capsys):
    benchmark_moe.main(["--tokens", "64", "--hidden", "32", "--experts", "4", "--ffn", "16", "--topk", "2",
                        "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert "| loop over experts |" in out and "| grouped GEMM |" in out
