"""Measuring helpers shared by tools/ and tests/: the config of a measurement run, its mock batches, and the
bytes tensors hold (what autograd saves for backward, what a rank keeps after a training step).

Why one home: a tool's figure (tools/memory_report.py, tools/benchmark_context_parallel.py) and the test that
holds the planner to the same figure (tests/test_plan.py, tests/test_zero.py) must be measured alike, and copies
of a measurement drift apart.
"""

from __future__ import annotations

import argparse
import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from megalite.config import Config
from megalite.config_cli import apply_mapping, load_yaml
from megalite.config_validation import validate
from megalite.data.batches import Batch, BatchMaker
from megalite.data.mock import MockDataset
from megalite.parallel.grad_buffer import GradBuffer
from megalite.parallel.topology import Topology
from megalite.parallel.weight_grads import WeightGradients
from megalite.training.build import build_trainer
from megalite.training.step import train_step

# What a measurement sets over its example: mock data instead of the corpus (no files or tokenizer to find), no
# checkpoints of its own, CPU ranks.
MEASUREMENT = {"data": {"mock": True, "paths": None, "train_paths": None, "valid_paths": None, "tokenizer_type": None},
               "checkpoint": {"save": None, "save_interval": None}, "train": {"device": "cpu"}}
# The tools' model-shape options (argparse destinations) and the model fields they set.
MODEL_OPTIONS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                 "kv_heads": "num_query_groups", "ffn": "ffn_hidden_size", "tie_embeddings": "tie_embeddings",
                 "rope_theta": "rope_theta", "seq": "seq_length", "vocab": "vocab_size", "experts": "num_experts",
                 "topk": "moe_topk", "expert_ffn": "moe_ffn_hidden_size"}
MEMORY_CATEGORIES = ("params", "grads", "main", "state")  # what rank_memory measures, by kind of tensor


def measurement_config(world_size: int, example: str | Path | None = None, **sections: dict[str, Any]) -> Config:
    """The validated config of a measurement on `world_size` ranks: the `example` YAML (as pretrain_gpt.py reads
    it) or the defaults, then MEASUREMENT, then `sections` (model={"num_layers": 4} sets model.num_layers; values
    are checked and converted as the YAML's are). Raises ConfigError naming every problem."""
    cfg = Config()
    if example is not None:
        load_yaml(cfg, str(example))
    apply_mapping(cfg, MEASUREMENT, "measurement defaults")
    apply_mapping(cfg, sections, "measurement options")
    validate(cfg, world_size)
    return cfg


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The model fields a tool's shape options set: those of MODEL_OPTIONS the tool has and that were given."""
    return {name: getattr(args, dest) for dest, name in MODEL_OPTIONS.items() if getattr(args, dest, None) is not None}


def param_dtype_fields(param_dtype: str | None) -> dict[str, str]:
    """The train fields a tool's --param-dtype sets: bf16 parameters train under bf16 precision (with fp32 main
    weights, as Megatron-LM's --bf16); fp32 parameters keep the precision; None keeps the config's dtypes."""
    if param_dtype is None:
        return {}
    return {"param_dtype": param_dtype} | ({} if param_dtype == "fp32" else {"precision": param_dtype})


def mock_batches(cfg: Config, count: int, dp_rank: int = 0, seed: int | None = None) -> list[Batch]:
    """`count` micro batches of train.micro_batch_size mock samples, different on each data-parallel rank;
    `seed` is the mock data's (default: train.seed)."""
    data = MockDataset(cfg.model.vocab, cfg.model.seq_length, cfg.train.seed if seed is None else seed)
    mbs = cfg.train.micro_batch_size
    return [BatchMaker()([data[(dp_rank * count + i) * mbs + j] for j in range(mbs)]) for i in range(count)]


@contextlib.contextmanager
def saved_storages(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Bytes of each distinct non-parameter storage autograd saves inside the block, by address. A view counts as
    the whole storage it keeps alive; what forward frees on its way is not saved, so it does not count."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def saved_bytes(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """Distinct non-parameter storages autograd saves while `step()` runs the forward (then its loss's backward)."""
    with saved_storages(model) as seen:
        loss = step()
    loss.backward()
    return sum(seen.values())


def held_for_w(queue: WeightGradients, params: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage a B's queued weight gradients hold for their W (parallel/weight_grads.py),
    parameters' own storages left out: the tensors their closures captured, in lists and tuples too."""

    def tensors(value: object) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)
        elif callable(value):
            for cell in getattr(value, "__closure__", None) or ():
                yield from tensors(cell.cell_contents)

    skip = {p.untyped_storage().data_ptr() for p in params}
    found = storages(t for _, compute, _ in queue.work for t in tensors(compute))
    return {ptr: size for ptr, size in found.items() if ptr not in skip}


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage behind `tensors`, keyed by its address (an empty one counts nothing)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if t.untyped_storage().nbytes()}


def kept_gradients(buffers: Iterable[GradBuffer]) -> list[torch.Tensor]:
    """What grad buffers keep between steps: each whole flat buffer, or from ZeRO-2 on this rank's shard of it."""
    return [b.strategy.grad_data if b.strategy.grad_data is not None else b.strategy.shard_data for b in buffers]


class GradientBytes:
    """The bytes the ZeRO strategies' gradient storage holds (whole buffers or shards, the buckets filling, the
    inputs of reductions in flight, which a collective keeps alive until it is waited for), sampled at every
    allocation, where a peak happens; `peak` is the most at once. Every such buffer is made by the strategies'
    one gradient allocation point, which tells its observers (parameter storage has its own), and is counted
    until it is really freed (weak references)."""

    def __init__(self) -> None:
        self.alive: list[tuple[weakref.ref, int]] = []
        self.peak = 0

    def watch(self, buffers: Iterable[GradBuffer]) -> None:
        """Count what `buffers` keep (made when they were built) and every gradient buffer they make from now on."""
        for buffer in buffers:
            self._made(kept_gradients([buffer])[0])
            buffer.strategy.observe_allocations(self._made)

    def _made(self, tensor: torch.Tensor) -> None:
        self.alive.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        self.peak = max(self.peak, self.now)

    @property
    def now(self) -> int:
        self.alive = [(ref, size) for ref, size in self.alive if ref() is not None]
        return sum(size for _, size in self.alive)


def rank_memory(rank: int, world_size: int, cfg: Config) -> dict[str, int]:
    """Build this rank's model and optimizer, train one step, and measure what stays allocated: bytes by
    MEMORY_CATEGORIES, the host copies of the gradients, the parameters held and the most gathered at once."""
    topology = Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel, cfg.model.num_experts > 0)
    gradients = GradientBytes()
    with build_trainer(cfg, topology) as parts:
        gradients.watch(parts.grads.buffers)
        params, mains = list(parts.model.parameters()), [m.main for m in parts.optimizer.shards()]
        train_step(parts, mock_batches(cfg, cfg.num_microbatches(world_size), topology.dp_rank))
    strategies = [b.strategy for b in parts.grads.buffers]
    held = storages(params + [s.param_shard for s in strategies if s.param_shard is not None])
    grads = storages(kept_gradients(parts.grads.buffers) + [t.grad for t in params + mains if t.grad is not None])
    main = {k: v for k, v in storages(mains).items() if k not in held}
    state = storages(t for s in parts.optimizer.optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor))
    sizes = {name: sum(found.values()) for name, found in zip(MEMORY_CATEGORIES, (held, grads, main, state))}
    sizes["host_grads"] = sum(storages(parts.optimizer.host_grads()).values())
    sharded = parts.sharded_params
    gathered = sharded.peak_elements * params[0].element_size() if sharded is not None else 0
    return {**sizes, "rank": rank, "pp_rank": topology.pp_rank, "numel": sum(p.numel() for p in params),
            "gathered": gathered, "grads_peak": gradients.peak}
