"""Build this rank's model and what trains it, from the config and the topology."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config import TORCH_DTYPES, Config
from megalite.model.gpt import GPTModel
from megalite.parallel.grads import GradientReducer
from megalite.parallel.layers import TPContext
from megalite.parallel.pipeline_layout import stage_layout
from megalite.parallel.topology import Topology
from megalite.training.step import Pipeline

TIED = {"embedding.word_embeddings.weight", "lm_head.weight"}


@dataclass
class RankModel:
    model: GPTModel
    tp: TPContext
    reducer: GradientReducer
    pipeline: Pipeline


def build_model(cfg: Config, device: torch.device, tp: TPContext, pp_rank: int) -> GPTModel:
    """Pipeline rank `pp_rank`'s model chunks, its tensor-parallel shards, in train.param_dtype."""
    model = GPTModel(cfg, device, tp, stage_layout(cfg, pp_rank))
    for param in model.parameters():  # initialised in fp32 on every layout, then rounded once
        param.data = param.data.to(TORCH_DTYPES[cfg.train.param_dtype])
    return model


def build_rank_model(cfg: Config, topology: Topology) -> RankModel:
    p = cfg.parallel
    tp = TPContext.from_topology(topology, p.sequence_parallel, cfg.train.seed)
    model = build_model(cfg, topology.device, tp, topology.pp_rank)
    if cfg.train.compile:
        for layer in model.layers.values():
            layer.compile()
    names = {name for name, _ in model.named_parameters()}
    tied = TIED & names if cfg.model.tied and topology.pp > 1 else set()
    reducer = GradientReducer(model, model.chunk_parameters(), topology, p, tied, set(model.aliases()))
    return RankModel(model, tp, reducer, Pipeline.build(cfg, topology))
