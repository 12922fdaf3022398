"""Training memory per rank, measured from the tensors, against the bytes-per-parameter accounting.

Why: the distributed optimizer is there to save memory, so the saving should be a number read
off the real tensors, not a formula. For each layout this tool starts tp*pp*dp gloo ranks on
the CPU, builds the model as training does (`build_trainer`), runs one
training step so that Adam's state exists, and sums numel * element_size over the distinct
storages behind (a view counts its whole storage, once; an empty one, such as a ZeRO-3 whole
parameter freed after use, counts nothing):
  - parameters: the model's parameters (with the distributed optimizer, the flat param buffer;
    at ZeRO-3, this rank's parameter slices);
  - gradients: the flat fp32 grad buffers and any .grad not inside them;
  - main weights: tensors the optimizer steps that do not share storage with a parameter;
  - optimizer state: every tensor in the optimizer's state (Adam's two moments and step counts).
Bytes per parameter divides the rank's total by the parameters it holds.

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
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch

from megalite.config import Config
from megalite.config_validation import validate
from megalite.config_cli import load_yaml
from megalite.data.batches import Batch, BatchMaker
from megalite.data.mock import MockDataset
from megalite.parallel.spawn import run_on_ranks
from megalite.parallel.topology import Topology
from megalite.planning.memory import gathered_bytes, state_bytes
from megalite.planning.parameters import rank_parameters
from megalite.training.build import build_trainer
from megalite.training.step import train_step

# A GPT-2-shaped model of 29M parameters: 8 ranks of it (444 MiB of tensors each) fit easily in 24 GB.
DEFAULT_MODEL = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 32000, "seq_length": 256}
MODEL_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads", "vocab": "vocab_size",
               "seq": "seq_length"}
CATEGORIES = ("params", "grads", "main", "state")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (as pretrain_gpt.py takes); without it, a ~29M-parameter GPT-2 shape")
    for flag, name in MODEL_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, help=f"model.{name} (overrides the config)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8], help="data-parallel sizes, one layout each")
    p.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="train.param_dtype (bf16 also sets bf16 precision)")
    p.add_argument("--zero-stage", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1, 2, 3],
                   help="parallel.zero_stage values, one table block each (1 = the distributed optimizer)")
    p.add_argument("--offload", action="store_true", help="optim.offload=cpu: main weights and Adam state on the host")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, dp: int, stage: int) -> Config:
    cfg = Config()
    if args.config:
        load_yaml(cfg, args.config)
    else:
        for name, value in DEFAULT_MODEL.items():
            setattr(cfg.model, name, value)
    for flag, name in MODEL_FLAGS.items():
        if getattr(args, flag) is not None:
            setattr(cfg.model, name, getattr(args, flag))
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero_stage = args.tp, args.pp, stage
    cfg.parallel.distributed_optimizer = stage >= 1
    if args.param_dtype != "fp32":
        cfg.train.param_dtype = cfg.train.precision = args.param_dtype
    cfg.optim.offload = "cpu" if args.offload else "none"
    # Mock data and pp micro batches per step (enough for any schedule): what stays allocated after
    # the step does not depend on the data or the batch.
    cfg.data.mock, cfg.data.paths, cfg.data.train_paths, cfg.data.valid_paths = True, None, None, None
    cfg.train.global_batch_size = cfg.train.micro_batch_size * dp * args.pp
    return cfg


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage behind `tensors`, keyed by its address."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if t.untyped_storage().nbytes()}


def mock_batches(cfg: Config, dp_rank: int, count: int) -> list[Batch]:
    """`count` micro batches of mock data, different on each data-parallel rank."""
    data, make, mbs = (MockDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed), BatchMaker(),
                       cfg.train.micro_batch_size)
    return [make([data[(dp_rank * count + i) * mbs + j] for j in range(mbs)]) for i in range(count)]


def rank_memory(rank: int, world_size: int, cfg: Config) -> dict[str, int]:
    """Build this rank's model and optimizer, train one step, and measure what stays allocated."""
    topology = Topology(rank, world_size, torch.device("cpu"), tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    with build_trainer(cfg, topology) as parts:
        params, mains = list(parts.model.parameters()), [m.main for m in parts.optimizer.shards()]
        train_step(parts, mock_batches(cfg, topology.dp_rank, cfg.num_microbatches(world_size)))
    strategies = [b.strategy for b in parts.grads.buffers]
    held = storages(params + [s.param_shard for s in strategies if s.param_shard is not None])
    kept = [s.grad_data if s.grad_data is not None else s.shard_data for s in strategies]
    grads = storages(kept + [t.grad for t in params + mains if t.grad is not None])
    main = {k: v for k, v in storages(mains).items() if k not in held}
    state = storages(t for s in parts.optimizer.optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor))
    sizes = {name: sum(found.values()) for name, found in zip(CATEGORIES, (held, grads, main, state))}
    sizes["host_grads"] = sum(storages(parts.optimizer.host_grads()).values())
    sharded = parts.sharded_params
    gathered = sharded.peak_elements * params[0].element_size() if sharded is not None else 0
    return {**sizes, "rank": rank, "pp_rank": topology.pp_rank, "numel": sum(p.numel() for p in params),
            "gathered": gathered}


def run_layout(cfg: Config, world_size: int) -> list[dict[str, int]]:
    """Spawn `world_size` fresh gloo ranks for one layout; returns each rank's measurement."""
    return run_on_ranks(world_size, rank_memory, cfg)


def row(cfg: Config, dp: int, ranks: list[dict[str, int]]) -> str:
    """The rank with the most device bytes (the one that must fit), the spread of totals over ranks, and the
    host bytes when offloaded."""
    on_host = ("main", "state") if cfg.optim.offload == "cpu" else ()

    def total(r: dict[str, int]) -> int:
        return sum(r[c] for c in CATEGORIES if c not in on_host)

    worst = max(ranks, key=total)
    expected = sum(state_bytes(cfg, 1, dp))  # the planner's accounting (megalite/planning/memory.py)
    mib = " | ".join(f"{worst[c] / 2**20:.1f}" for c in CATEGORIES)
    spread = f"{min(map(total, ranks)) / 2**20:.1f}-{total(worst) / 2**20:.1f}"
    planned = gathered_bytes(cfg, rank_parameters(cfg, worst["pp_rank"]), dp)[0]
    gathered = (f"{worst['gathered'] / 2**20:.1f} | {planned / 2**20:.1f}" if cfg.parallel.zero >= 3 and dp > 1
                else "- | -")
    return (f"| {dp} | {cfg.parallel.zero} | {worst['rank']} | {worst['numel'] / 1e6:.2f}M | {mib} "
            f"| {total(worst) / 2**20:.1f} | {spread} | {total(worst) / worst['numel']:.3f} | {expected:.3g} "
            f"| {gathered} | {(sum(worst[c] for c in on_host) + worst['host_grads']) / 2**20:.1f} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    m = build_config(args, 1, 0).model
    print(f"{m.family}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
          f"vocab {m.vocab_size} (padded {m.padded_vocab_size}), seq {m.seq_length}; tp={args.tp} pp={args.pp}; "
          f"{args.param_dtype} parameters; optimizer offload {'cpu' if args.offload else 'none'}; "
          f"torch {torch.__version__}")
    print("| dp | ZeRO stage | rank shown | parameters held | params MiB | grads MiB | main weights MiB "
          "| optimizer state MiB | device MiB | device MiB over ranks | device bytes/param | expected "
          "| gathered MiB measured | gathered MiB planned | host MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for stage in args.zero_stage:
        for dp in args.dp:
            cfg = build_config(args, dp, stage)
            world_size = args.tp * args.pp * dp
            validate(cfg, world_size)
            print(row(cfg, dp, run_layout(cfg, world_size)), flush=True)


if __name__ == "__main__":
    main()
