"""The predicted step time of a layout on a cluster: compute at a stated utilisation, the schedule's bubble, and
each axis's communication on the link its groups cross, hidden where megalite overlaps it.

Per pipeline stage (the slowest sets the step):
- compute: the hardware FLOPs of one micro batch (model FLOPs plus what recompute runs again: training/flops.py)
  on one rank, seq x micro batch tokens over tp x cp ranks, the layers' share 1/pp and the LM head's on the last
  stage, at `mfu` of the GPU's dense peak (what one GPU reaches on this model alone: gpu_check measures it);
- per micro batch, on the critical path: tp's collectives (megalite does not overlap them), ep's all-to-alls,
  the pipeline's sends and the context-parallel all-gather; ring attention (cp p2p) runs its hops beside the
  attention blocks, so only what exceeds the attention's compute shows; ZeRO-3's gathers and ZeRO-2/3's
  per-backward reductions run beside the next layer's compute (what exceeds it shows);
- the bubble: the schedule's formula (its ScheduleSpec) at F = B = W over those per-micro-batch times;
- once a step: the gradient reduction, overlapped with the last micro batch's backward (parallel.overlap_grad_reduce),
  and ZeRO-1/2's parameter all-gather, exposed unless parallel.overlap_param_gather hides it behind a forward.
A collective's time on a link of B bytes/s (planning/cluster.py) is as NCCL's tests count bus bandwidth: an
all-gather or reduce-scatter of a P-byte tensor over n ranks moves (n-1)/n P per rank, an all-reduce twice that;
an all-to-all of a P-byte tensor sends (n-1)/n P (balanced), a point-to-point payload is what a rank sends. The
all-gather expert dispatcher's "ep" calls run over the etp x ep group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megalite.config import Config, ModelConfig
from megalite.parallel.pipeline.registry import bubble_fraction
from megalite.parallel.topology import RankGrid
from megalite.planning.cluster import Cluster
from megalite.planning.memory import grid_replicas
from megalite.planning.plan import GPUS
from megalite.planning.traffic import Traffic, step_traffic
from megalite.training.flops import PEAK_TFLOPS, hardware_flops_per_token, matmul_parameters, training_flops_per_token

GROUP_AXES = {"tp": ("dense", ("tp",)), "cp": ("dense", ("cp",)), "dp": ("dense", ("cp", "dp")),
              "pp": ("dense", ("pp",)), "ep": ("expert", ("ep",)), "etp": ("expert", ("etp",)),
              "edp": ("expert", ("edp",))}
RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}  # x (n-1)/n


@dataclass(frozen=True)
class AxisTime:
    """One axis's traffic in a step of one rank: its transfer seconds, how many of them the step waits for."""

    axis: str
    payload: int  # bytes, as planning/traffic.py counts them
    seconds: float
    waits: float  # exposed seconds that recur with the micro batches (stretched by the bubble)
    once: float  # exposed seconds once a step
    network: bool  # its groups cross nodes

    @property
    def exposed(self) -> float:
        return self.waits + self.once


@dataclass(frozen=True)
class StepTime:
    """The terms of one pipeline stage's step (module docstring)."""

    pp_rank: int
    microbatches: int
    compute: float  # seconds of one micro batch's forward and backward at the MFU
    per_microbatch: float  # compute plus the communication each micro batch waits for
    bubble: float  # the schedule's idle fraction
    step_exposed: float  # once-a-step communication the step waits for
    axes: tuple[AxisTime, ...]

    @property
    def seconds(self) -> float:
        return self.microbatches * self.per_microbatch * (1 + self.bubble) + self.step_exposed

    def terms(self) -> dict[str, float]:
        """The step's seconds by cause, summing to `seconds`: compute, the bubble, and each axis's exposed
        communication (a per-micro-batch wait stretched by the bubble as the compute is)."""
        stretch = 1 + self.bubble
        terms = {"compute": self.microbatches * self.compute, "bubble": self.microbatches * self.compute * self.bubble}
        for axis in self.axes:
            terms[axis.axis] = axis.waits * stretch + axis.once
        return terms


def peak_flops(cfg: Config, gpu: str) -> float:
    """The GPU's dense peak in FLOP/s for train.precision (ValueError when training/flops.py has none)."""
    peak = PEAK_TFLOPS[GPUS[gpu][1]].get(cfg.train.precision)
    if peak is None:
        raise ValueError(f"{gpu} has no {cfg.train.precision} peak in megalite/training/flops.py PEAK_TFLOPS")
    return peak * 1e12


_FLOPS: dict[tuple[int, str], tuple[ModelConfig, tuple[float, float, float]]] = {}


def flops_per_token(m: ModelConfig, recompute: str) -> tuple[float, float, float]:
    """(hardware FLOPs of the layers, of the LM head, model FLOPs of attention's square) per token, remembered
    per model object (a search asks thousands of times for one model)."""
    known = _FLOPS.get((id(m), recompute))
    if known is not None and known[0] is m:
        return known[1]
    head = 6 * m.hidden_size * m.vocab
    figures = (hardware_flops_per_token(m, recompute) - head, head,
               training_flops_per_token(m) - 6 * matmul_parameters(m))
    _FLOPS[(id(m), recompute)] = (m, figures)
    return figures


def compute_seconds(cfg: Config, pp_rank: int, gpu: str, mfu: float) -> tuple[float, float]:
    """(one micro batch's forward and backward on one rank of stage `pp_rank`, of which attention's s x s
    square) in seconds at `mfu`."""
    m, p = cfg.model, cfg.parallel
    tokens = m.seq_length * cfg.train.micro_batch_size / (p.tp * p.cp)
    layers, head, attention = flops_per_token(m, cfg.train.recompute)
    per_token = layers / p.pp + (head if pp_rank == p.pp - 1 else 0)
    rate = peak_flops(cfg, gpu) * mfu
    return tokens * per_token / rate, tokens * attention / p.pp / rate


def transfer_seconds(call: Traffic, size: int, bandwidth: float) -> float:
    """Seconds the call's payload takes on a group of `size` ranks at `bandwidth` bytes/s per direction."""
    factor = RING_FACTOR.get(call.call)
    moved = call.payload * factor * (size - 1) / size if factor else call.payload
    return moved / bandwidth


def stage_step(cfg: Config, world_size: int, cluster: Cluster, mfu: float, pp_rank: int,
               buffers: dict[str, list[int]]) -> StepTime:
    """Stage `pp_rank`'s step: `buffers` its gradient buffers' elements by rank grid (planning/traffic.py)."""
    p = cfg.parallel
    grids = {"dense": RankGrid.for_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp),
             "expert": RankGrid.experts_for_world(world_size, etp=p.etp, ep=p.ep, pp=p.pp)}
    replicas = grid_replicas(cfg, world_size)
    m = cfg.num_microbatches(world_size)
    compute, attention = compute_seconds(cfg, pp_rank, cluster.gpu, mfu)
    axes = []
    for call in step_traffic(cfg, pp_rank, buffers, replicas, m):
        grid, group = GROUP_AXES[call.axis]
        group = ("etp", "ep") if call.axis == "ep" and p.moe_dispatcher == "allgather" else group
        size = math.prod(grids[grid].size(axis) for axis in group)
        bandwidth, network = cluster.bandwidth(grids[grid], group)
        seconds = transfer_seconds(call, size, bandwidth)
        exposed = _exposed(cfg, call, seconds, m, compute, attention)
        waits, once = (exposed, 0.0) if call.per_microbatch else (0.0, exposed)
        axes.append(AxisTime(call.axis, call.payload, seconds, waits, once, network))
    per_microbatch = compute + sum(a.waits for a in axes) / m
    bubble = bubble_fraction(p.pipeline_schedule, p.pp, p.vp, m) if p.pp > 1 else 0.0
    return StepTime(pp_rank, m, compute, per_microbatch, bubble, sum(a.once for a in axes), tuple(_merge(axes)))


def _exposed(cfg: Config, call: Traffic, seconds: float, m: int, compute: float, attention: float) -> float:
    """What of `seconds` the step waits for, by where megalite overlaps the call (module docstring)."""
    p = cfg.parallel
    if call.axis == "cp" and call.call == "send":
        return max(0.0, seconds - m * attention)  # the ring's hops beside the attention blocks
    if call.axis in ("dp", "edp"):
        if call.per_microbatch:  # ZeRO-2/3: beside the next layer's compute
            return max(0.0, seconds - m * compute / 3)
        if call.call == "all_gather":
            return max(0.0, seconds - compute / 3) if p.overlap_param_gather else seconds
        return max(0.0, seconds - 2 * compute / 3) if p.overlap_grad_reduce else seconds
    return seconds


def _merge(axes: list[AxisTime]) -> list[AxisTime]:
    """One AxisTime per axis (its calls' sums)."""
    merged: dict[str, AxisTime] = {}
    for a in axes:
        b = merged.get(a.axis)
        merged[a.axis] = a if b is None else AxisTime(a.axis, a.payload + b.payload, a.seconds + b.seconds,
                                                      a.waits + b.waits, a.once + b.once, a.network or b.network)
    return list(merged.values())


def step_time(cfg: Config, world_size: int, cluster: Cluster, mfu: float,
              buffers: list[dict[str, list[int]]]) -> StepTime:
    """The slowest stage's step: `buffers[r]` stage r's gradient buffers. The first, second and last stages stand
    for all: the middle ones hold the same layers and talk to two neighbours, as the second does."""
    stages = sorted({0, min(1, cfg.parallel.pp - 1), cfg.parallel.pp - 1})
    return max((stage_step(cfg, world_size, cluster, mfu, r, buffers[r]) for r in stages), key=lambda t: t.seconds)
