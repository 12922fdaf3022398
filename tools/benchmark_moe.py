"""One mixture-of-experts layer, forward + backward: the grouped GEMM (torch._grouped_mm, what megalite runs)
against a loop over the experts (one matmul each, the split sizes read on the host), in one process.

Both run the same MoELayer (router, sort, experts, weighted combine) on the same tokens; only the experts'
two projections differ: the loop is a matmul recipe (parallel/gemm.py) applied to the layer. Times are medians
over `--iters` steps after `--warmup`, per layer.

    python tools/benchmark_moe.py                         # 2048 tokens, hidden 512, 16 experts of 256, top-4
    python tools/benchmark_moe.py --precision bf16 --experts 64 --topk 8
    python tools/benchmark_moe.py --device cuda --tokens 16384 --hidden 2048 --experts 128 --ffn 768 --topk 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.model.aux_losses import AuxLosses
from megalite.model.init import init_parameters
from megalite.model.moe.layer import MoELayer
from megalite.parallel.context import ParallelContext
from megalite.parallel.gemm import HighPrecision, RowGroups, apply_recipe
from megalite.parallel.placement import parameter_placements
from megalite.parallel.topology import synchronize
from megalite.training.step import precision_context


class ExpertLoop(HighPrecision):
    """The reference: one matmul per expert over its rows (sizes read on the host), both ways."""

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        return torch.cat([F.linear(part, weight[e].to(x.dtype)) for e, part in enumerate(x.split(groups.sizes))])

    def grouped_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        return torch.cat([g.matmul(weight[e].to(g.dtype)) for e, g in enumerate(grad.split(groups.sizes))])

    def grouped_weight_grad(self, grad: torch.Tensor, x: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        pairs = zip(grad.split(groups.sizes), x.split(groups.sizes))
        return torch.stack([g.t().matmul(part.to(g.dtype)) for g, part in pairs])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro batch (seq x batch)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ffn", type=int, default=256, help="each expert's width")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 = autocast")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args(argv)


def layer_seconds(layer: MoELayer, x: torch.Tensor, args: argparse.Namespace) -> float:
    device = torch.device(args.device)
    times = []
    for i in range(args.warmup + args.iters):
        layer.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        with precision_context(args.precision, device):
            out = layer(x)
        out.float().square().mean().backward()
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig(family="llama", num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
                      num_experts=args.experts, moe_topk=args.topk, moe_ffn_hidden_size=args.ffn,
                      moe_aux_loss_coeff=0.01)
    layer = MoELayer(cfg, ParallelContext(), AuxLosses(), 0).to(device)
    with torch.no_grad():
        init_parameters(layer, 0, cfg, parameter_placements(layer, False), ParallelContext().coord, {})
    x = torch.randn(args.tokens, 1, args.hidden, device=device, generator=torch.Generator(device).manual_seed(0))
    grouped = layer_seconds(layer, x, args)
    apply_recipe(layer.experts, ExpertLoop())
    loop = layer_seconds(layer, x, args)
    print(f"MoE layer forward + backward: {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
          f"{args.ffn}, top-{args.topk}, {args.precision} on {args.device} ({torch.get_num_threads()} threads)")
    print("| implementation | ms per layer | speed-up |\n|---|---|---|")
    print(f"| loop over experts | {loop * 1e3:.1f} | 1.00 |")
    print(f"| grouped GEMM | {grouped * 1e3:.1f} | {loop / grouped:.2f} |")


if __name__ == "__main__":
    main()
