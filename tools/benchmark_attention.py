"""Time and peak memory of one attention forward+backward with a sliding window and sinks, against full causal
attention and against SDPA given the window as a mask, at long sequences (gpt-oss's heads by default).

    python tools/benchmark_attention.py --device cuda                 # seq 8192 and 32768, window 128
    python tools/benchmark_attention.py --device cpu --seq 2048 --heads 4 --kv-heads 2   # anywhere, small

Three ways, on the same bf16 (CUDA) / fp32 (CPU) q, k, v:
  causal       SDPA with is_causal (FlashAttention on CUDA): what a layer without a window runs;
  window+sinks megalite's windowed attention (model/windowed_attention.py): FlashAttention's window arguments on
               CUDA, the CPU kernel with each block's mask there, sinks folded into its log-sum-exp;
  window mask  SDPA with the window as a boolean [seq, seq] mask: what a model gets without a windowed kernel.
Each prints `RESULT <way> seq=<n> ms=<median forward+backward> peak_gib=<peak allocated beyond the inputs>` (CUDA:
the allocator's peak; on the CPU, 0: the allocator keeps no peak there), or `RESULT <way> seq=<n> failed=<error>`.
Timing: the median of --repeat runs after one warm-up, synchronised on CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root on the path
from megalite.model.windowed_attention import windowed_attention  # noqa: E402

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    return p.parse_args(argv)


def _ways(window: int, seq: int, device: torch.device) -> dict:
    def causal(q, k, v, sinks):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def window_and_sinks(q, k, v, sinks):
        return windowed_attention(q, k, v, window, sinks)

    def window_mask(q, k, v, sinks):
        distance = torch.arange(seq, device=device).unsqueeze(1) - torch.arange(seq, device=device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance >= 0) & (distance < window),
                                              enable_gqa=True)

    return {"causal": causal, "window+sinks": window_and_sinks, "window mask": window_mask}


def measure(fn, args: argparse.Namespace, seq: int, device: torch.device) -> tuple[float, float]:
    """(median milliseconds, peak GiB beyond the inputs) of fn's forward+backward."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, args.heads, seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, args.kv_heads, seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    sinks = torch.nn.Parameter(torch.zeros(args.heads, device=device))
    times, peak = [], 0.0
    for run in range(args.repeat + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn(q, k, v, sinks).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / GIB)
        if run:
            times.append((time.perf_counter() - start) * 1e3)
        q.grad = k.grad = v.grad = sinks.grad = None
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, heads {args.heads} (kv {args.kv_heads}) x {args.head_dim}, "
          f"window {args.window}")
    for seq in args.seq:
        for name, fn in _ways(args.window, seq, device).items():
            try:
                ms, peak = measure(fn, args, seq, device)
                print(f"RESULT {name} seq={seq} ms={ms:.3f} peak_gib={peak:.3f}", flush=True)
            except (RuntimeError, torch.OutOfMemoryError) as error:  # a way that cannot run at this length
                print(f"RESULT {name} seq={seq} failed={type(error).__name__}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
