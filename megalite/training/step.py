"""One optimizer step: forward/backward over the micro batches, gradient reduction across
data-parallel replicas, unscale and overflow check, clipping, and the update.

Each micro batch's loss is its summed token loss divided by the token count of the whole
global batch (all data-parallel ranks together), so the gradient and the reported loss
are the global batch's per-token mean in every layout, loss masks included.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.data.batches import Batch
from megalite.config import TORCH_DTYPES, Config
from megalite.model.gpt import GPTModel
from megalite.parallel.grads import GradientReducer
from megalite.parallel.p2p import PipelineComm
from megalite.parallel.schedules import StageInfo, Trace, run_schedule
from megalite.parallel.topology import Topology
from megalite.training.loss_scaler import LossScaler


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision != "fp32":
        return torch.autocast(device.type, dtype=TORCH_DTYPES[precision])
    return contextlib.nullcontext()


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    tokens: int
    diverged: bool = False  # skipped for a NaN/Inf gradient norm (not an fp16 overflow the loss scaler handles)


def global_token_count(batches: list[Batch], topology: Topology) -> torch.Tensor:
    count = sum(b.loss_mask.sum() for b in batches).to(topology.device, torch.float32).reshape(1)
    dist.all_reduce(count, group=topology.dp_group)
    return count


@dataclass
class Pipeline:
    """How this rank runs its micro batches: the schedule, its stage, and the p2p channel (pp > 1)."""

    schedule: str
    stage: StageInfo
    comm: PipelineComm | None = None
    trace: Trace | None = None

    @classmethod
    def build(cls, cfg: Config, topology: Topology) -> "Pipeline":
        stage = StageInfo(topology.pp, cfg.parallel.vp, topology.pp_rank)
        if topology.pp == 1:
            return cls(cfg.parallel.pipeline_schedule, stage)
        sharded = cfg.parallel.sequence_parallel and topology.tp > 1
        seq = cfg.model.seq_length // topology.tp if sharded else cfg.model.seq_length
        comm = PipelineComm(topology, (seq, cfg.train.micro_batch_size, cfg.model.hidden_size), TORCH_DTYPES[cfg.train.param_dtype])  # the residual stream's dtype
        return cls(cfg.parallel.pipeline_schedule, stage, comm)


def train_step(model: GPTModel, optimizer: torch.optim.Optimizer, scaler: LossScaler, reducer: GradientReducer,
               batches: list[Batch], topology: Topology, precision: str, clip_grad: float, pipeline: Pipeline) -> StepResult:
    reducer.zero()
    total_tokens = global_token_count(batches, topology)
    batches = [b.to(topology.device) for b in batches]
    loss_sum = torch.zeros(1, device=topology.device)

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        nonlocal loss_sum
        batch = batches[microbatch]
        with precision_context(precision, topology.device):
            out = model(batch.tokens, batch.labels, batch.position_ids, hidden=hidden, chunk=chunk)
        if not model.stage.is_last_chunk(chunk):
            return out
        loss = (out * batch.loss_mask).sum() / total_tokens
        loss_sum = loss_sum + loss.detach()
        return loss * scaler.scale

    run_schedule(pipeline.schedule, len(batches), forward_step, pipeline.stage, pipeline.comm, pipeline.trace, reducer.start_sync)
    reducer.reduce()
    dist.all_reduce(loss_sum, group=topology.dp_group)
    overflow = reducer.any_overflow(scaler.unscale_and_check(reducer.grads()))
    scaler.update(overflow)
    if overflow:
        reducer.after_step()
        return StepResult(float(loss_sum), float("nan"), True, int(total_tokens.item()))
    grad_norm = reducer.clip(clip_grad)
    if not math.isfinite(grad_norm):  # the norm is global, so every rank skips together
        reducer.after_step()
        return StepResult(float(loss_sum), grad_norm, True, int(total_tokens.item()), diverged=True)
    optimizer.step()
    reducer.after_step()
    return StepResult(float(loss_sum), grad_norm, False, int(total_tokens.item()))
