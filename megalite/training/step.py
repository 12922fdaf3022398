"""One optimizer step: forward/backward over the micro batches, gradient reduction across
data-parallel replicas, unscale and overflow check, clipping, and the update.

The gradient and the reported loss are the global batch's per-token mean (all data-parallel
ranks together, loss masks included) in every layout. The global count of unmasked tokens is
only known after a collective, and a collective at the start of the step would queue on the
data-parallel communicator behind the previous step's overlapped parameter gathers, stalling
the first forward. So, as Megatron-LM does, each micro batch's summed token loss is divided by
the number of positions in the global batch (known without communication), the token count is
all-reduced together with the loss after the schedule, and the gradients are corrected by
positions / tokens (exactly 1 when nothing is masked) in the clipping multiply.
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
    batches = [b.to(topology.device) for b in batches]
    positions = sum(b.loss_mask.numel() for b in batches) * topology.dp
    loss_sum = torch.zeros(1, device=topology.device)

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        nonlocal loss_sum
        batch = batches[microbatch]
        with precision_context(precision, topology.device):
            out = model(batch.tokens, batch.labels, batch.position_ids, hidden=hidden, chunk=chunk)
        if not model.stage.is_last_chunk(chunk):
            return out
        loss = (out * batch.loss_mask).sum() / positions
        loss_sum = loss_sum + loss.detach()
        return loss * scaler.scale

    run_schedule(pipeline.schedule, len(batches), forward_step, pipeline.stage, pipeline.comm, pipeline.trace, reducer.start_sync)
    reducer.reduce()
    tokens = sum(b.loss_mask.sum(dtype=torch.float64) for b in batches).reshape(1)  # exact beyond 2^24 tokens
    totals = torch.cat((loss_sum.double(), tokens))
    dist.all_reduce(totals, group=topology.dp_group)
    correction = (positions / totals[1].clamp(min=1.0)).float()
    loss, tokens = float(totals[0] * correction), int(totals[1].item())
    overflow = reducer.any_overflow(scaler.unscale_and_check(reducer.grads()))
    scaler.update(overflow)
    if overflow:
        reducer.after_step()
        return StepResult(loss, float("nan"), True, tokens)
    grad_norm = reducer.clip(clip_grad, correction)
    if not math.isfinite(grad_norm):  # the norm is global, so every rank skips together
        reducer.after_step()
        return StepResult(loss, grad_norm, True, tokens, diverged=True)
    optimizer.step()
    reducer.after_step()
    return StepResult(loss, grad_norm, False, tokens)
