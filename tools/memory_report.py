"""Training memory per rank, measured from the tensors, against the bytes-per-parameter accounting.

Why: the distributed optimizer is there to save memory, so the saving should be a number read
off the real tensors, not a formula. For each layout this tool starts tp*pp*dp gloo ranks on
the CPU, builds the model as training does (`build_trainer`), runs one
training step so that Adam's state exists, and sums numel * element_size over the distinct
storages behind (a view counts its whole storage, once; an empty one, such as a ZeRO-3 whole
parameter freed after use, counts nothing):
  - parameters: the model's parameters (with the distributed optimizer, the flat param buffer;
    at ZeRO-3, this rank's parameter slices);
  - gradients: the flat fp32 grad buffers and any .grad not inside them, after the step; and "grads MiB
    at peak", the most gradient storage alive at once during the step (what runs out): the buffers and
    shards, the buckets filling and the inputs and outputs of reductions in flight (planning/measure.py
    GradientBytes). ZeRO-2/3 reduce every micro batch and land each reduction early, so their peak is
    the 1/dp shard plus a few buckets, not a full buffer;
  - main weights: tensors the optimizer steps that do not share storage with a parameter;
  - optimizer state: every tensor in the optimizer's state (Adam's two moments and step counts).
Bytes per parameter divides the rank's total by the parameters it holds; "expected" is the planner's figure
for the same rank (megalite/planning/memory.py).

Mixture-of-experts models (--experts, or a config with model.num_experts) hold num_experts/ep experts per rank
(--ep), whose gradients are reduced and optimizer state sharded over edp = world / (ep x pp) ranks rather
than dp: their bytes per parameter differ from the dense parts', and "expected" mixes the two as the rank does.

Megatron-LM counts 18 bytes/param for bf16 parameters with fp32 main weights and grads
(2 + 4 + 4 + 8), and 6 + 12/dp with the distributed optimizer (ZeRO-1): that is `--param-dtype
bf16` (train.param_dtype=bf16). ZeRO-2 shards the gradients too: 2 + 16/dp; ZeRO-3 the parameters
too: 18/dp. With fp32 parameters the optimizer steps them directly (no copy): 4 + 4 + 8 = 16 at
stage 0, 8 + 8/dp at stage 1, 4 + 12/dp at stage 2 and 16/dp at stage 3.

With --offload (optim.offload=cpu) main weights and Adam's state live in host memory: the total
and bytes/param count the device only (parameters and gradients: 2 + 4/dp at stage 2), and a
"host MiB" column adds up what lives on the host (main weights, optimizer state and the host copies
the reduced gradients land in). On this CPU machine host and device are the same memory, so the
split is by where each tensor is meant to live.

ZeRO-3 also holds whole parameters of the units being used (parallel/zero/stage3.py) for a moment: the
"gathered" columns give the most elements gathered at once during the step (`peak_elements` of
`Trainer.sharded_params`) in bytes, next to the planner's figure for them (planning/memory.py
`gathered_bytes`, its parameter part; the planner adds one unit's gradients on top).

    python tools/memory_report.py                        # bf16 params; dp 1, 2, 4, 8; ZeRO stages 0, 1, 2, 3
    python tools/memory_report.py --param-dtype fp32
    python tools/memory_report.py --offload --dp 2 --zero-stage 1 2 3
    python tools/memory_report.py --tp 2 --pp 2 --dp 2 --zero-stage 1 --config examples/tiny_cpu.yaml
    python tools/memory_report.py --experts 8 --topk 2 --expert-ffn 512 --ep 4 --dp 4 --zero-stage 1
"""

from __future__ import annotations

import argparse

import torch

from megalite.config import Config, ModelConfig
from megalite.parallel.spawn import run_on_ranks
from megalite.planning.measure import (
    MEMORY_CATEGORIES,
    MODEL_OPTIONS,
    measurement_config,
    model_fields,
    param_dtype_fields,
    rank_memory,
)
from megalite.planning.memory import gathered_bytes, stage_memory

# A GPT-2-shaped model of 29M parameters: 8 ranks of it (444 MiB of tensors each) fit easily in 24 GB.
DEFAULT_MODEL = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 32000, "seq_length": 256}
MODEL_FLAGS = ("layers", "hidden", "heads", "vocab", "seq", "experts", "topk", "expert_ffn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (as pretrain_gpt.py takes); without it, a ~29M-parameter GPT-2 shape")
    for flag in MODEL_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int,
                       help=f"model.{MODEL_OPTIONS[flag]} (overrides the config)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="parallel.sequence_parallel (mixture-of-experts layers need it at tp > 1)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8], help="data-parallel sizes, one layout each")
    p.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="train.param_dtype (bf16 also sets bf16 precision)")
    p.add_argument("--zero-stage", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1, 2, 3],
                   help="parallel.zero_stage values, one table block each (1 = the distributed optimizer)")
    p.add_argument("--offload", action="store_true", help="optim.offload=cpu: main weights and Adam state on the host")
    p.add_argument("--microbatches", type=int, default=4,
                   help="micro batches per step (a multiple of --pp): stages 2-3 reduce every one of them")
    p.add_argument("--bucket-size", type=int, help="parallel.bucket_size (elements per gradient bucket)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, dp: int, stage: int) -> Config:
    """The layout's validated config. One sample per micro batch, --microbatches of them per step: what stays
    allocated after the step does not depend on the data or the batch, the peak during it on the micro batches."""
    bucket = {"bucket_size": args.bucket_size} if args.bucket_size else {}
    return measurement_config(
        args.tp * args.pp * dp, args.config, model={**({} if args.config else DEFAULT_MODEL), **model_fields(args)},
        parallel={"tp": args.tp, "pp": args.pp, "ep": args.ep, "sequence_parallel": args.sequence_parallel,
                  "zero_stage": stage, "distributed_optimizer": stage >= 1, **bucket},
        train={"micro_batch_size": 1, "global_batch_size": dp * args.microbatches,
               **param_dtype_fields(args.param_dtype)},
        optim={"offload": "cpu" if args.offload else "none"})


def run_layout(cfg: Config, world_size: int) -> list[dict[str, int]]:
    """Spawn `world_size` fresh gloo ranks for one layout; returns each rank's measurement."""
    return run_on_ranks(world_size, rank_memory, cfg)


def row(cfg: Config, dp: int, ranks: list[dict[str, int]]) -> str:
    """The rank with the most device bytes (the one that must fit), the spread of totals over ranks, and the
    host bytes when offloaded."""
    on_host = ("main", "state") if cfg.optim.offload == "cpu" else ()

    def total(r: dict[str, int]) -> int:
        return sum(r[c] for c in MEMORY_CATEGORIES if c not in on_host)

    worst = max(ranks, key=total)
    planned = stage_memory(cfg, len(ranks), worst["pp_rank"], "cpu")
    expected = planned.state / planned.parameters.total  # the planner's accounting (megalite/planning/memory.py)
    columns = ["params", "grads", "grads_peak", "main", "state"]  # MEMORY_CATEGORIES and the peak beside grads
    mib = " | ".join(f"{worst[c] / 2**20:.1f}" for c in columns)
    spread = f"{min(map(total, ranks)) / 2**20:.1f}-{total(worst) / 2**20:.1f}"
    planned_gather = gathered_bytes(cfg, planned.parameters, dp)[0]
    gathered = (f"{worst['gathered'] / 2**20:.1f} | {planned_gather / 2**20:.1f}" if cfg.parallel.zero >= 3 and dp > 1
                else "- | -")
    return (f"| {dp} | {cfg.parallel.zero} | {worst['rank']} | {worst['numel'] / 1e6:.2f}M | {mib} "
            f"| {total(worst) / 2**20:.1f} | {spread} | {total(worst) / worst['numel']:.3f} | {expected:.3g} "
            f"| {gathered} | {(sum(worst[c] for c in on_host) + worst['host_grads']) / 2**20:.1f} |")


def _experts(m: ModelConfig) -> str:
    return f", {m.num_experts} experts (top {m.moe_topk}, {m.expert_ffn_size} wide)" if m.num_experts else ""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    m = build_config(args, args.dp[0], args.zero_stage[0]).model
    print(f"{m.family}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
          f"vocab {m.vocab_size} (padded {m.padded_vocab_size}), seq {m.seq_length}{_experts(m)}; "
          f"tp={args.tp} pp={args.pp} ep={args.ep}; "
          f"{args.param_dtype} parameters; optimizer offload {'cpu' if args.offload else 'none'}; "
          f"torch {torch.__version__}")
    print("| dp | ZeRO stage | rank shown | parameters held | params MiB | grads MiB | grads MiB at peak "
          "| main weights MiB "
          "| optimizer state MiB | device MiB | device MiB over ranks | device bytes/param | expected "
          "| gathered MiB measured | gathered MiB planned | host MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for stage in args.zero_stage:
        for dp in args.dp:
            cfg = build_config(args, dp, stage)
            print(row(cfg, dp, run_layout(cfg, args.tp * args.pp * dp)), flush=True)


if __name__ == "__main__":
    main()
