"""The models the planner reads: a rank's, built on the meta device as training builds it, and the one-device one.

The planner keeps no description of layer shapes: it builds the real model (training/build.py build_model, with
activation recompute applied and split norms under a zero-bubble schedule) on the meta device, where nothing is
allocated or drawn, for one tensor-, context- and expert-parallel rank of a pipeline stage, and reads its
parameters (their shapes and placements) and its modules' cost declarations (model/costs.py). A build takes
milliseconds (0.2 s for the one-device 405B); the same config's models are built once (`functools.lru_cache` over
the config fields they read, all plain values: `BUILT_FIELDS`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch import nn

from megalite.config import Config, ModelConfig, ParallelConfig, TrainConfig
from megalite.model.costs import MicroBatch
from megalite.model.gpt import GPTModel
from megalite.parallel.context import AxisView, ParallelContext
from megalite.training.build import build_model

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # per element, by dtype name


def token_rows(cfg: Config) -> tuple[int, int]:
    """(this rank's tokens of a micro batch, seq/cp per sample; rows of its residual stream: tokens / tp under SP)."""
    tokens = cfg.model.seq_length // cfg.parallel.cp * cfg.train.micro_batch_size
    return tokens, tokens // cfg.parallel.tp if cfg.parallel.sequence_parallel_active else tokens


def micro_batch(cfg: Config, device: str = "cuda") -> MicroBatch:
    """One micro batch of `cfg` on one rank, run by `device`'s kernels ("cuda" or "cpu")."""
    tokens, rows = token_rows(cfg)
    return MicroBatch(tokens, rows, BYTES[cfg.train.precision], BYTES[cfg.train.param_dtype], device)


def section_values(section: object) -> tuple:
    """A config section's field values in order, lists as tuples: a cache key that builds the section again."""
    values = (getattr(section, field.name) for field in dataclasses.fields(section))
    return tuple(tuple(value) if isinstance(value, list) else value for value in values)


# The fields of the parallel and train sections a rank's model is built from (training/build.py build_model and
# the ParallelContext below): configs that differ only elsewhere (micro batch, ZeRO stage, buckets, ...) share one
# build, which a layout search relies on.
BUILT_FIELDS = {
    "parallel": ("tp", "pp", "cp", "cp_comm", "ep", "etp", "moe_dispatcher", "vp", "pipeline_schedule",
                 "first_stage_layers", "last_stage_layers", "sequence_parallel"),
    "train": ("precision", "param_dtype", "fp8_recipe", "fp8_first_last_layers_bf16", "fp8_num_layers_at_start_in_bf16",
              "fp8_num_layers_at_end_in_bf16", "fp8_output_head", "recompute", "fusions"),
}


def _built_values(section: object, names: tuple[str, ...]) -> tuple:
    """The values of `names` in `section`, lists as tuples: the part of a cache key a build reads."""
    values = (getattr(section, name) for name in names)
    return tuple(tuple(value) if isinstance(value, list) else value for value in values)


_MODEL_KEYS: dict[int, tuple[ModelConfig, tuple, tuple]] = {}


def model_key(m: ModelConfig) -> tuple:
    """`section_values(m)`, remembered per model object while its values stay the same (a layout search asks
    for one model's key thousands of times; comparing is cheaper than rebuilding it)."""
    known = _MODEL_KEYS.get(id(m))
    if known is not None and known[0] is m and known[1] == tuple(vars(m).values()):
        return known[2]
    key = section_values(m)
    _MODEL_KEYS[id(m)] = (m, tuple(vars(m).values()), key)
    return key


def rank_model(cfg: Config, pp_rank: int = 0) -> GPTModel:
    """Pipeline rank `pp_rank`'s model on one rank of its tensor-, context- and expert-parallel groups, on the meta
    device."""
    return _rank_model(model_key(cfg.model), _built_values(cfg.parallel, BUILT_FIELDS["parallel"]),
                       _built_values(cfg.train, BUILT_FIELDS["train"]), pp_rank)


@functools.lru_cache(maxsize=256)
def _rank_model(model: tuple, parallel: tuple, train: tuple, pp_rank: int) -> GPTModel:
    sections = {name: dict(zip(BUILT_FIELDS[name], values)) for name, values in
                (("parallel", parallel), ("train", train))}
    cfg = Config(model=ModelConfig(*model), parallel=ParallelConfig(**sections["parallel"]),
                 train=TrainConfig(**{k: list(v) if isinstance(v, tuple) else v for k, v in sections["train"].items()}))
    p = cfg.parallel
    ctx = ParallelContext(tp=AxisView(size=p.tp), cp=AxisView(size=p.cp), sequence_parallel=p.sequence_parallel_active,
                          cp_comm=p.cp_comm, ep=AxisView(size=p.ep), etp=AxisView(size=p.etp),
                          ep_etp=AxisView(size=p.ep * p.etp), expert_dispatcher=p.moe_dispatcher)
    return build_model(cfg, torch.device("meta"), ctx, pp_rank)


def one_device_model(m: ModelConfig) -> GPTModel:
    """The whole model on one device (tp = pp = 1), on the meta device."""
    return _one_device_model(section_values(m))


@functools.lru_cache(maxsize=16)
def _one_device_model(model: tuple) -> GPTModel:
    return GPTModel(ModelConfig(*model), torch.device("meta"), seed=0)


def _layers(cfg: Config) -> Iterator[tuple[int, nn.Module]]:
    """(global index, layer) of every transformer layer of the rank models, stage by stage."""
    for pp_rank in range(cfg.parallel.pp):
        for index, layer in rank_model(cfg, pp_rank).layers.items():
            yield int(index), layer


def first_layer(cfg: Config) -> nn.Module:
    """The model's first transformer layer as `cfg`'s layout shards it: built alone, as the first stage of a pipeline
    with a layer per stage (its shape and recompute flags are those of any stage's first layer; a layout search asks
    for many layouts' and builds one layer each)."""
    parallel = dataclasses.replace(cfg.parallel, pp=cfg.model.num_layers, vp=1, pipeline_schedule="1f1b",
                                   first_stage_layers=None, last_stage_layers=None)
    return rank_model(dataclasses.replace(cfg, parallel=parallel), 0).layers["0"]


def moe_block(cfg: Config) -> nn.Module:
    """The model's first mixture-of-experts block, from the rank model of the stage that holds it."""
    block = next((layer.mlp for index, layer in _layers(cfg) if index in cfg.model.moe_layers), None)
    if block is None:
        raise ValueError("the model has no mixture-of-experts layer (model.num_experts = 0)")
    return block
