"""Build this rank's model and what trains it, from the config and the topology."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.checkpoint.sharded_state import ShardedState
from megalite.config import TORCH_DTYPES, Config
from megalite.config_fp8 import fp8_layer_numbers
from megalite.model.fused import apply_fusions
from megalite.model.gpt import TIED_COPY, GPTModel, embedding_copy
from megalite.model.recompute import apply_recompute
from megalite.model.split_backward import apply_split_backward
from megalite.parallel.context import ParallelContext
from megalite.parallel.ddp import DataParallelGrads
from megalite.parallel.distributed_optimizer import DistributedOptimizer
from megalite.parallel.fp8 import RECIPES
from megalite.parallel.fp8.param_gather import gathered_weights
from megalite.parallel.gemm import apply_recipe
from megalite.parallel.grad_buffer import readers
from megalite.parallel.pipeline.registry import pipeline_stage, schedule_spec, stage_layout
from megalite.parallel.pipeline.runner import Pipeline
from megalite.parallel.topology import Topology
from megalite.parallel.zero import GatherUnits, ShardedParameters, unit_index
from megalite.training.loss_scaler import LossScaler
from megalite.training.qk_clip import QKClip


@dataclass
class Trainer:
    """Everything one rank trains with: its model chunks and tensor-parallel context, the data-parallel
    gradients, the optimizer, the loss scaler and the pipeline schedule with its channel."""

    cfg: Config
    topology: Topology
    model: GPTModel
    ctx: ParallelContext
    grads: DataParallelGrads
    optimizer: DistributedOptimizer
    scaler: LossScaler
    pipeline: Pipeline
    sharded_params: GatherUnits | None = None  # ZeRO-3 where a grid has more than one data-parallel replica
    qk_clip: QKClip | None = None  # optim.qk_clip_threshold

    def sharded_state(self) -> ShardedState:
        """The checkpoint's view of the model and optimizer state this rank holds."""
        return ShardedState(self.model, self.optimizer, self.model.placements_by_name(), self.topology)

    def close(self) -> None:
        """Land every collective the trainer left in flight: the overlapped parameter gathers a step leaves for
        the next forward, ZeRO-3's prefetched gathers, gradient reductions of a step that was cut short.
        Destroying the process group while one is in flight aborts the process on NCCL (and, on gloo, whenever
        a background thread still touches the group), so whoever drives `train_step` closes the trainer
        before the group goes: `with build_trainer(cfg, topology) as trainer: ...`. Safe to call twice."""
        self.optimizer.wait_params()
        self.grads.wait()
        if self.sharded_params is not None:
            self.sharded_params.wait_all()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_model(cfg: Config, device: torch.device, ctx: ParallelContext, pp_rank: int) -> GPTModel:
    """Pipeline rank `pp_rank`'s model chunks, its shards (`ctx`), in train.param_dtype, with train.recompute
    applied, train.fp8_recipe on the transformer layers' linears and experts, multi-token prediction's included
    (the embedding, the head, the routers and MTP's projection keep train.precision, as DeepSeek-V3 and torchtitan
    keep them; `_apply_fp8` says which layers and when the head), and the split backward where the schedule
    splits it (model/split_backward.py)."""
    # Each parameter is drawn in fp32 on every layout and rounded once into train.param_dtype as it is copied in
    # (model/init.py); its storage is made in that dtype, so no fp32 copy of the model is ever on the device.
    model = GPTModel(cfg.model, device, ctx, stage_layout(cfg, pp_rank), seed=cfg.train.seed,
                     dtype=TORCH_DTYPES[cfg.train.param_dtype])
    apply_recompute(model, cfg.train.recompute)
    apply_fusions(model, cfg.train.fusions)
    if cfg.train.fp8_recipe != "none":
        _apply_fp8(model, cfg)
    if schedule_spec(cfg.parallel.pipeline_schedule).split_backward:
        apply_split_backward(model)
    return model


def _apply_fp8(model: GPTModel, cfg: Config) -> None:
    """train.fp8_recipe on the transformer layers config_fp8.fp8_layer_numbers names (numbered along the whole
    model, so every pipeline layout runs the same layers in FP8) and multi-token prediction's, and on the LM head
    with train.fp8_output_head."""
    recipe = RECIPES[cfg.train.fp8_recipe]()
    in_fp8 = fp8_layer_numbers(cfg)
    for number, layer in model.layers.items():
        if int(number) in in_fp8:
            apply_recipe(layer, recipe)
    for depth in model.mtp.layers if model.mtp is not None else ():
        apply_recipe(depth.transformer_layer, recipe)
    if cfg.train.fp8_output_head and model.lm_head is not None:
        apply_recipe(model.lm_head, recipe)


def build_rank_model(cfg: Config, topology: Topology) -> GPTModel:
    """This rank's model in its parallel context, compiled layer by layer (multi-token prediction's layers too)
    when train.compile asks: what build_trainer trains, and what a benchmark's bare loop runs without the trainer
    around it."""
    p = cfg.parallel
    ctx = ParallelContext.from_topology(topology, p.sequence_parallel_active, cfg.train.seed, p.cp_comm,
                                        p.moe_dispatcher)
    model = build_model(cfg, topology.device, ctx, topology.pp_rank)
    if cfg.train.compile:
        for layer in model.transformer_layers():
            layer.compile()
    return model


def build_trainer(cfg: Config, topology: Topology) -> Trainer:
    """The one place that assembles training: pretrain, the tools and the tests all start here."""
    p = cfg.parallel
    if cfg.model.num_experts and "expert" not in topology.grids:
        raise ValueError("the model has experts (model.num_experts) but the topology has no expert grid: build it "
                         "with experts=True (Topology.from_config(..., experts=cfg.model.num_experts > 0))")
    model = build_rank_model(cfg, topology)
    names = {name for name, _ in model.named_parameters()}
    copy = embedding_copy(cfg.model)
    tied = {copy, TIED_COPY[1]} & names if copy is not None and topology.pp > 1 else set()
    placements = model.placements_by_name()
    modules = model.chunk_modules()
    units = unit_index(modules) if p.zero >= 3 else None
    fp8 = gathered_weights(model) if cfg.train.fp8_param_gather else None
    grads = DataParallelGrads(model, model.chunk_parameters(), topology, p, placements, tied, units, readers(modules),
                              fp8)
    stage3 = any(isinstance(buffer.strategy, ShardedParameters) for buffer in grads.buffers)
    sharded = GatherUnits(modules, grads.buffers) if stage3 else None
    optimizer = DistributedOptimizer(model, grads.buffers, topology, cfg.optim, p.zero >= 1,
                                     p.overlap_param_gather, placements, model.hidden_matrices(cfg.optim.muon_routers),
                                     torch.float32 if cfg.train.precision == "fp32" else torch.bfloat16)
    scaler = LossScaler.for_precision(cfg.train.precision, cfg.optim)
    clip = None
    if cfg.optim.qk_clip_threshold is not None:
        clip = QKClip(model, optimizer, topology, cfg.optim.qk_clip_threshold,
                      cfg.model.num_layers + cfg.model.mtp_num_layers)
        optimizer.after_update = clip.apply
    return Trainer(cfg, topology, model, model.ctx, grads, optimizer, scaler, Pipeline.build(cfg, topology), sharded,
                   clip)


def is_logging_rank(cfg: Config, topology: Topology) -> bool:
    """The last rank of the pipeline stage holding the LM head, where the loss is known: the last rank, unless the
    schedule's chunk order puts the head elsewhere (ZB-V's V: on the first stage)."""
    head = pipeline_stage(cfg.parallel, 0).head_rank
    return topology.rank == max(ranks[head] for ranks in topology.grid.groups(("pp",)))
