"""What parity tests compare with one device: the tiny runs (distributed.tiny_run) of the data-parallel and ZeRO tests
(four layers, eight micro batches of one sample per step, clipping active (0.5, below every step's norm),
small buckets so every layer spans several), and `train_and_gather`, a few steps in a spawned rank that
also gathers the gradients every optimizer stepped with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import tiny_run

from megalite.config import Config
from megalite.data.batches import BatchMaker
from megalite.data.loader import micro_batches
from megalite.data.mock import MockDataset
from megalite.parallel.placement import DATA_AXES, unshard
from megalite.parallel.topology import Topology, release_process_groups
from megalite.training.build import Trainer, build_trainer
from megalite.training.lr_schedule import learning_rate
from megalite.training.step import StepResult, train_step

LLAMA = ["--model.family=llama", "--model.num_query_groups=4"]
TINY = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8", "--model.seq_length=32",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.global_batch_size=8", "--train.train_iters=5",
        "--optim.clip_grad=0.5", "--parallel.bucket_size=5000", "--logging.progress_bar=false",
        "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0"]


def clipped_run(tmp_path: Path, nproc: int, *extra: str, name: str = "") -> list[float]:
    """The step losses of one run of the tiny model on `nproc` processes, checking clipping was active."""
    records = tiny_run(tmp_path, nproc, *extra, base=TINY, name=name)
    assert all(r["grad_norm"] > 0.5 for r in records), "clipping must be active in these tests"
    return [r["loss"] for r in records]


def train_and_gather(cfg: Config, topology: Topology, steps: int = 3, data: MockDataset | None = None,
                     maker: BatchMaker | None = None, record: Callable[[Trainer, StepResult], Any] | None = None
                     ) -> tuple[list, dict[str, torch.Tensor]]:
    """`steps` optimizer steps of `cfg` on mock data (or `data`, batched by `maker`); returns this rank's step
    losses (the loss is known on the LM head's stage), or what `record` makes of each step, and the gradients
    every optimizer stepped with at the last step, whole, by one-device name: each rank's owned slices (all of
    them, or its share under ZeRO) summed over the ranks holding the same parameters (the placement's data axes)
    and divided by how many hold each element, then the shards (tp, ep, etp) put together."""
    gbs = cfg.batch_size(topology.world_size)
    data = data or MockDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
    record = record or (lambda _, result: result.loss)
    records = []
    with build_trainer(cfg, topology) as parts:
        for step in range(steps):
            batches = list(micro_batches(data, maker or BatchMaker(), step * gbs, (step + 1) * gbs,
                                         cfg.train.micro_batch_size, topology.dp, topology.dp_rank, 0, topology.device))
            parts.optimizer.set_lr(learning_rate(step + 1, cfg.optim, steps))
            records.append(record(parts, train_step(parts, batches)))
        return records, whole_shards(parts, topology, lambda shard: shard.grad)


def on_one_device(cfg: Config, run: Callable[[Config, Topology], Any] = train_and_gather) -> Any:
    """`run(cfg, topology)` in this (the test's) process as one device, its process groups released after: the
    reference a spawned layout is compared with."""
    topology = Topology.from_environment("cpu", cfg.parallel, cfg.model.num_experts > 0)
    try:
        return run(cfg, topology)
    finally:
        release_process_groups()


def whole_shards(parts, topology: Topology, of) -> dict[str, torch.Tensor]:
    """`of(shard)` of every optimizer shard (its gradient, its main weights), whole, by one-device name."""
    named, placements = dict(parts.model.named_parameters()), parts.model.placements_by_name()
    sums = {name: torch.zeros(p.numel()) for name, p in named.items()}
    counts = {name: torch.zeros(p.numel()) for name, p in named.items()}
    for shard in parts.optimizer.shards():
        sums[shard.name][shard.start:shard.end] += of(shard).float().reshape(-1)
        counts[shard.name][shard.start:shard.end] += 1
    copies, grads = parts.model.tied_copies(), {}
    for name, param in named.items():
        placement = placements[name]
        data = DATA_AXES[placement.grid]
        if topology.size(*data, grid=placement.grid) > 1:
            for tensor in (sums[name], counts[name]):
                dist.all_reduce(tensor, group=topology.group(*data, grid=placement.grid))
        grad = (sums[name] / counts[name]).view(param.shape)
        for axis, spec in reversed(placement.shards):
            if topology.size(axis, grid=placement.grid) > 1:
                pieces = [torch.empty_like(grad) for _ in range(topology.size(axis, grid=placement.grid))]
                dist.all_gather(pieces, grad.contiguous(), group=topology.group(axis, grid=placement.grid))
                grad = unshard(pieces, spec)
        grads[copies.get(name, name)] = grad
    return grads


def assert_equals_one_device(layout: str, losses: list[float], per_rank: list, index: int,
                             reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    """Case `index`'s losses, and every gradient merged over the ranks' results (per_rank[rank][index][1]),
    equal the one-device run's `reference`: fp32, rel 1e-5."""
    ref_losses, ref_grads = reference
    assert losses == pytest.approx(ref_losses, rel=1e-5), layout
    merged = {}
    for rank_results in per_rank:
        merged |= rank_results[index][1]
    assert merged.keys() == ref_grads.keys(), layout
    for name, grad in merged.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")
