"""Build this rank's model and what trains it, from the config and the topology."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import Config
from megalite.model.gpt import GPTModel
from megalite.parallel.grads import GradientReducer
from megalite.parallel.layers import TPContext
from megalite.parallel.pipeline_layout import StageLayout
from megalite.parallel.topology import Topology
from megalite.training.step import DTYPES, Pipeline

TIED = {"embedding.word_embeddings.weight", "lm_head.weight"}


@dataclass
class RankModel:
    model: GPTModel
    tp: TPContext
    reducer: GradientReducer
    pipeline: Pipeline


def build_rank_model(cfg: Config, topology: Topology) -> RankModel:
    p = cfg.parallel
    tp = TPContext.from_topology(topology, p.sequence_parallel, cfg.train.seed)
    if topology.pp > 1:
        stage = StageLayout.for_rank(cfg.model.num_layers, topology.pp, p.vp, topology.pp_rank, p.first_stage_layers, p.last_stage_layers)
    else:
        stage = StageLayout.single(cfg.model.num_layers)
    model = GPTModel(cfg, topology.device, tp, stage)
    for param in model.parameters():  # initialised in fp32 on every layout, then rounded once
        param.data = param.data.to(DTYPES[cfg.train.param_dtype])
    if cfg.train.compile:
        for layer in model.layers.values():
            layer.compile()
    names = {name for name, _ in model.named_parameters()}
    tied = TIED & names if cfg.model.tied and topology.pp > 1 else set()
    reducer = GradientReducer(model, model.chunk_parameters(), topology, p, tied, set(model.aliases()))
    return RankModel(model, tp, reducer, Pipeline.build(cfg, topology))
