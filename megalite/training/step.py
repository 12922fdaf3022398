"""One optimizer step: forward/backward over the micro batches, gradient reduction across
data-parallel replicas, unscale and overflow check, clipping, and the update.

The gradient and the reported loss are the global batch's per-token mean (all data-parallel
ranks together, loss masks included) in every layout; context-parallel ranks each hold a part of
every sequence, so their sums add up over the data- and context-parallel ranks together. The
global count of unmasked tokens is only known after a collective, and a collective at the start
of the step would queue on the data-parallel communicator behind the previous step's overlapped
parameter gathers, stalling the first forward. So, as Megatron-LM does, each micro batch's summed
token loss is divided by the number of positions in the global batch (known without
communication), the token count is all-reduced together with the loss after the schedule, and
the gradients are corrected by positions / tokens (exactly 1 when nothing is masked) in the
clipping multiply.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from megalite.data.batches import Batch
from megalite.config import TORCH_DTYPES
from megalite.parallel.context_parallel import local_positions
from megalite.parallel.schedules import ForwardStep, run_schedule

if TYPE_CHECKING:
    from megalite.training.build import Trainer


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


def local_batches(trainer: "Trainer", batches: list[Batch]) -> list[Batch]:
    """The micro batches on this rank's device, cut to its part of every sequence under context parallelism."""
    t = trainer.topology
    batches = [b.to(t.device) for b in batches]
    if t.cp == 1:
        return batches
    positions = local_positions(trainer.cfg.model.seq_length, t.cp, t.cp_rank, t.device)
    return [b.select(positions) for b in batches]


def microbatch_forward(trainer: "Trainer", batches: list[Batch],
                       on_last_chunk: Callable[[torch.Tensor, Batch], torch.Tensor]) -> ForwardStep:
    """The schedule's forward step, shared by training and evaluation: run model chunk `chunk` on micro
    batch `microbatch` in the configured precision; on the last chunk hand the per-token losses and the
    batch to `on_last_chunk`, whose result (what backward starts from, when training) is returned."""
    model, precision, device = trainer.model, trainer.cfg.train.precision, trainer.topology.device

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        batch = batches[microbatch]
        with precision_context(precision, device):
            out = model(batch.tokens, batch.labels, batch.position_ids, hidden=hidden, chunk=chunk)
        return on_last_chunk(out, batch) if model.stage.is_last_chunk(chunk) else out

    return forward_step


def train_step(trainer: "Trainer", batches: list[Batch]) -> StepResult:
    """One optimizer step of `trainer` over this rank's micro batches."""
    t, grads, optimizer, scaler = trainer.topology, trainer.grads, trainer.optimizer, trainer.scaler
    grads.zero()
    batches = local_batches(trainer, batches)
    positions = sum(b.loss_mask.numel() for b in batches) * t.dp_cp
    loss_sum = torch.zeros(1, device=t.device)

    def scaled_loss(out: torch.Tensor, batch: Batch) -> torch.Tensor:
        nonlocal loss_sum
        loss = (out * batch.loss_mask).sum() / positions
        loss_sum = loss_sum + loss.detach()
        return loss * scaler.scale

    pipeline = trainer.pipeline
    forward_step = microbatch_forward(trainer, batches, scaled_loss)
    run_schedule(pipeline.schedule, len(batches), forward_step, pipeline.stage, pipeline.comm, pipeline.trace,
                 grads.start_sync)
    grads.reduce(optimizer.grads_landed)
    optimizer.collect_grads()
    tokens = sum(b.loss_mask.sum(dtype=torch.float64) for b in batches).reshape(1)  # exact beyond 2^24 tokens
    totals = torch.cat((loss_sum.double(), tokens))
    dist.all_reduce(totals, group=t.dp_cp_group)
    correction = (positions / totals[1].clamp(min=1.0)).float()
    loss, tokens = float(totals[0] * correction), int(totals[1].item())
    # Only fp16's dynamic loss scale can overflow; other precisions skip the check and its host-syncing vote.
    overflow = scaler.dynamic and optimizer.any_overflow(scaler.unscale_and_check(optimizer.grads()))
    scaler.update(overflow)
    if overflow:
        optimizer.finish_step()
        return StepResult(loss, float("nan"), True, tokens)
    grad_norm = optimizer.clip(trainer.cfg.optim.clip_grad, correction)
    if not math.isfinite(grad_norm):  # the norm is global, so every rank skips together
        optimizer.finish_step()
        return StepResult(loss, grad_norm, True, tokens, diverged=True)
    optimizer.step()
    return StepResult(loss, grad_norm, False, tokens)
