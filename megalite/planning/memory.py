"""Memory per GPU: model state (weights, gradients, fp32 main weights, Adam) plus the activations
of the micro batches the pipeline schedule keeps in flight, for the pipeline stage that needs most.

Model state follows megalite/parallel/grad_buffer.py and ddp.py: parameters in
train.param_dtype; gradients in parallel.grad_reduce_dtype; fp32 main weights only when the
parameters are not fp32 (fp32 parameters are stepped in place); Adam's two fp32 moments (Muon's matrices: one,
its momentum). Each
ZeRO stage shards one more of them over the ranks holding the same weights: dp x cp (context-
parallel ranks are replicas too, parallel/topology.py dp_cp), written `dp` below and in the
functions. For bf16 parameters with fp32 gradients, bytes per parameter are:
  stage 0: 18 (2 + 4 + 4 + 8, Megatron-LM's accounting);
  stage 1: 6 + 12/dp (main weights and moments sharded: the distributed optimizer);
  stage 2: 2 + 16/dp (gradients too);
  stage 3: 18/dp (parameters too), plus the gather units in flight, counted as transient.
For fp32 parameters: 16, 8 + 8/dp, 4 + 12/dp, 16/dp. optim.offload=cpu takes the main weights
and moments (12 or 8 of those bytes, before dividing) off the device. Under train.fp8_param_gather each weight
gathered in FP8 (parallel/fp8/param_gather.py) adds its FP8 slice (1/dp byte) and, at stages 1-2, its whole FP8
copy (1 byte); ZeRO-3's gathered units hold those weights as one byte per element.

Experts' weights live on the expert grid (placement.py): their gradients are reduced, and ZeRO shards
them, over that grid's data axes, the expert-data-parallel ranks (edp = world / (ep x pp)), not over
dp x cp. `grid_replicas` reads which axes those are from placement.py DATA_AXES for each grid.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch import nn

from megalite.config import Config
from megalite.model import costs
from megalite.parallel.pipeline.registry import schedule_spec, stage_layout
from megalite.parallel.placement import DATA_AXES
from megalite.parallel.topology import RankGrid
from megalite.planning.activations import chunk_costs
from megalite.planning.built import BYTES, micro_batch, rank_model
from megalite.planning.context_parallel import attention_transient_bytes
from megalite.planning.muon import MuonStep, stage_steps
from megalite.planning.parameters import Parameters, rank_parameters


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline stage `pp_rank` (every tp/dp rank of a stage holds the same)."""

    pp_rank: int
    parameters: Parameters
    weights: float
    gradients: float
    main_weights: float
    optimizer: float
    activations: float  # at the schedule's peak (held weight-gradient inputs included)
    in_flight: int  # (chunk, micro batch) forwards whose activations or weight-gradient inputs are held then
    transient: float  # short-lived: see `transient_bytes`
    expert_state: float = 0.0  # the experts' share of weights + gradients + main weights + optimizer state
    muon: tuple[MuonStep, ...] = ()  # each rank's Muon step (planning/muon.py), with optim.optimizer=muon

    @property
    def state(self) -> float:
        return self.weights + self.gradients + self.main_weights + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.transient


def state_bytes(cfg: Config, numel: int, dp: int, muon: int = 0, fp8: int = 0) -> tuple[float, float, float, float]:
    """(weights, gradients, main weights, optimizer state) device bytes for `numel` parameters on one rank, `muon`
    of them stepped by Muon (one fp32 momentum instead of Adam's two moments), `fp8` gathered in FP8 (their FP8
    copies are counted with the weights); offloaded (optim.offload=cpu) main weights and optimizer state live in
    host memory instead."""
    t, p = cfg.train, cfg.parallel
    shards = dp if p.zero >= 1 else 1
    grads = numel * BYTES[p.grad_reduce_dtype] / (dp if p.zero >= 2 else 1)
    fp8_copies = 1 if dp == 1 else (p.zero < 3) + 1 / dp  # one replica: its slice is the whole copy
    weights = numel * BYTES[t.param_dtype] / (dp if p.zero >= 3 else 1) + fp8 * fp8_copies
    if cfg.optim.offload == "cpu":
        return weights, grads, 0.0, 0.0
    main = 0 if t.param_dtype == "fp32" else 4
    return weights, grads, numel * main / shards, (numel * 8 - muon * 4) / shards


def grid_replicas(cfg: Config, world_size: int) -> dict[str, int]:
    """Per rank grid, how many ranks hold the same parameters and see different data: the sizes of the grid's
    data axes (placement.py DATA_AXES) in this layout. Dense: dp x cp; expert: edp = world / (etp x ep x pp)."""
    p = cfg.parallel
    grids = {"dense": RankGrid.for_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp),
             "expert": RankGrid.experts_for_world(world_size, etp=p.etp, ep=p.ep, pp=p.pp)}
    return {name: math.prod(grid.size(axis) for axis in DATA_AXES[name]) for name, grid in grids.items()}


def grid_state_bytes(cfg: Config, params: Parameters, shards: dict[str, int]) -> dict[str, tuple[float, ...]]:
    """`state_bytes` of each grid's parameters, sharded over that grid's replicas (`shards`)."""
    return {grid: state_bytes(cfg, numel, shards[grid], params.muon_by_grid[grid], params.fp8_by_grid[grid])
            for grid, numel in params.by_grid.items()}


def gathered_elements(params: Parameters, unit_sizes: tuple[float, ...] | None = None) -> tuple[float, int]:
    """ZeRO-3 (parallel/zero/stage3.py): (parameter, gradient) elements of whole gather units present at once,
    at worst (`unit_sizes`: each unit's size in other terms, its bytes, instead of its elements). Parameters: the
    unit running and the one prefetched (any two units stand in for adjacent ones: an upper bound), plus the
    embedding unit when a later unit on this rank reads it (a tied LM head, multi-token prediction: it stays
    gathered from that unit's backward to the embedding's). Gradients: one unit's bucket buffers fill in backward
    until reduce-scattered (the next unit's first gradient comes after), the largest."""
    units = unit_sizes if unit_sizes is not None else params.units
    if params.tied_head:
        rest = sorted(units[1:], reverse=True)
        return units[0] + sum(rest[:2]), max(params.units)
    return sum(sorted(units, reverse=True)[:2]), max(params.units, default=0)


def gathered_bytes(cfg: Config, params: Parameters, dp: int) -> tuple[float, float]:
    """(parameter, gradient) bytes of `gathered_elements`, the weights gathered in FP8 one byte each; none below
    ZeRO-3 or at dp 1 (nothing sharded)."""
    if cfg.parallel.zero < 3 or dp == 1:
        return 0.0, 0.0
    param = BYTES[cfg.train.param_dtype]
    fp8 = params.fp8_units or (0,) * len(params.units)
    weights, grads = gathered_elements(params, tuple((n - f) * param + f for n, f in zip(params.units, fp8)))
    return weights, grads * BYTES[cfg.parallel.grad_reduce_dtype]


def waiting_gradient_bytes(model: nn.Module, param_dtype: str) -> int:
    """A parameter that several units of one backward read keeps its earlier reads' gradients in a tensor of its
    own size until the last read adds into the buffer (parallel/grad_buffer.py `deposit`), alive beside the next
    read's gradient as it is made: with multi-token prediction the head's weight (each depth reads it again) and,
    with several depths, their shared word-embedding copy."""
    if getattr(model, "mtp", None) is None:
        return 0
    head = model.lm_head.weight if model.lm_head.weight is not None else model.mtp.word_embeddings.weight
    tables = {id(head): head}
    if len(model.mtp.layers) > 1 and model.mtp.word_embeddings.weight is not None:
        tables[id(model.mtp.word_embeddings.weight)] = model.mtp.word_embeddings.weight
    return sum(t.numel() for t in tables.values()) * BYTES[param_dtype]


def transient_bytes(cfg: Config, pp_rank: int, params: Parameters, shards: dict[str, int], activations: float,
                    device: str = "cuda", muon_peak: int = 0) -> float:
    """Memory above state + activations at the worst moment on pipeline stage `pp_rank`: in backward, the largest
    parameter's gradient before its hook adds it into the buffer or, at another moment, a layer's own backward
    temporaries (`costs.backward_transient_bytes`: the MoE combine's), whichever is more, plus a gradient waiting
    for a later read of its parameter (`waiting_gradient_bytes`), plus under full recompute the one layer whose
    activations are being recomputed, plus under ZeRO-3 the whole units gathered (`gathered_bytes`), plus
    context-parallel attention's buffers (planning/context_parallel.py), less on the stage with the head what the
    head saved (its backward runs first and frees it, before any layer is recomputed); there, as the loss's forward
    ends with every activation held, its temporaries (the head's `transient_bytes`, model/costs.py) and the units
    gathered then; in the optimizer step (activations and whole units freed), fp32 copies of bf16-reduced gradient
    slices for the fp32 main weights (each grid's over its own `shards`, the replicas) and, with Muon, its update's
    `muon_peak` (planning/muon.py: the whole matrices and their iteration on the stage's busiest owner rank)."""
    model, batch = rank_model(cfg, pp_rank), micro_batch(cfg, device)
    gathered_weights, gathered_grads = gathered_bytes(cfg, params, shards["dense"])
    head = model.lm_head is not None
    loss = costs.transient_bytes(model.lm_head, batch) + gathered_weights if head else 0
    layer_temporaries = max((costs.backward_transient_bytes(layer, batch) for layer in model.transformer_layers()),
                            default=0)
    backward = (max(params.largest * BYTES[cfg.train.param_dtype], layer_temporaries) + gathered_weights
                + gathered_grads + attention_transient_bytes(cfg, batch.compute)
                + waiting_gradient_bytes(model, cfg.train.param_dtype))
    if cfg.train.recompute == "full":
        kept = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="none"))
        layers = rank_model(kept, pp_rank).transformer_layers()
        backward += max((costs.saved_bytes(layer, batch) for layer in layers), default=0)
        backward -= costs.saved_bytes(model.final_norm, batch) + costs.saved_bytes(model.lm_head, batch) if head else 0
    sharded = cfg.parallel.zero >= 1
    copies = sum(numel * 4 / (shards[grid] if sharded else 1) for grid, numel in params.by_grid.items())
    step = (copies if cfg.parallel.grad_reduce_dtype != "fp32" else 0) + muon_peak
    return max(backward, loss, step - activations)


def chunk_activation_bytes(cfg: Config, pp_rank: int, device: str = "cuda") -> list[int]:
    """One micro batch's saved bytes for each model chunk of pipeline stage `pp_rank`."""
    return chunk_costs(cfg, pp_rank, device, costs.saved_bytes)


def chunk_held_bytes(cfg: Config, pp_rank: int, device: str = "cuda") -> list[int]:
    """One micro batch's weight-gradient inputs, held from its B to its W, for each model chunk of pipeline stage
    `pp_rank`; none unless the schedule splits the backward."""
    if not schedule_spec(cfg.parallel.pipeline_schedule).split_backward:
        return [0] * stage_layout(cfg, pp_rank).vp
    return chunk_costs(cfg, pp_rank, device, costs.held_bytes)


def peak_activations(cfg: Config, world_size: int, pp_rank: int, device: str = "cuda") -> tuple[int, int]:
    """(peak bytes, micro batches in flight then) over this stage's schedule: a forward stores its chunk's
    activations until the matching backward frees them (parallel/pipeline/executor.py); a backward (B) with a W
    leaves the chunk's weight-gradient inputs until that W."""
    p = cfg.parallel
    sizes, held_inputs = chunk_activation_bytes(cfg, pp_rank, device), chunk_held_bytes(cfg, pp_rank, device)
    spec = schedule_spec(p.pipeline_schedule)
    ops = spec.rank_ops(p.pp, p.vp, pp_rank, cfg.num_microbatches(world_size))
    deferring = {(op.chunk, op.microbatch) for op in ops if op.kind == "W"}
    held, count, peak = 0, 0, (0, 0)
    for kind, chunk, mb in (part for op in ops for part in op.parts):  # a pair's forward before its backward frees
        if kind == "F":
            held, count = held + sizes[chunk], count + 1
        elif kind == "B":
            split = (chunk, mb) in deferring
            held, count = held - sizes[chunk] + split * held_inputs[chunk], count - (not split)
        else:
            held, count = held - held_inputs[chunk], count - 1
        peak = max(peak, (held, count))
    return peak


def stage_memory(cfg: Config, world_size: int, pp_rank: int, device: str = "cuda") -> StageMemory:
    params = rank_parameters(cfg, pp_rank)
    shards = grid_replicas(cfg, world_size)
    grids = grid_state_bytes(cfg, params, shards)
    state = [sum(parts) for parts in zip(*grids.values())]  # weights, gradients, main weights, optimizer
    activations, in_flight = peak_activations(cfg, world_size, pp_rank, device)
    muon = stage_steps(cfg, world_size, pp_rank)
    transient = transient_bytes(cfg, pp_rank, params, shards, activations, device,
                                max((step.peak for step in muon), default=0))
    return StageMemory(pp_rank, params, *state, activations, in_flight, transient, sum(grids["expert"]), tuple(muon))


def memory_per_stage(cfg: Config, world_size: int, device: str = "cuda") -> list[StageMemory]:
    return [stage_memory(cfg, world_size, rank, device) for rank in range(cfg.parallel.pp)]
