"""One optimizer step: forward/backward over the micro batches, gradient reduction across
data-parallel replicas, unscale and overflow check, clipping, and the update.

Nothing in a step reads a device value on the host (each read stalls a GPU pipeline), except fp16's
overflow vote: the loss, gradient norm and token count stay on the device (StepResult), clipping
scales on the device, and a step whose gradient norm is NaN/Inf is skipped by the fused AdamW kernel
itself (its found_inf input) rather than by a host decision.

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megalite.config import TORCH_DTYPES
from megalite.data.batches import Batch
from megalite.data.mtp_targets import mtp_targets
from megalite.parallel.context_parallel import local_positions
from megalite.parallel.pipeline.executor import ForwardStep, run_schedule
from megalite.training.expert_bias import update_expert_biases

if TYPE_CHECKING:
    from megalite.training.build import Trainer


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision != "fp32":
        return torch.autocast(device.type, dtype=TORCH_DTYPES[precision])
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepFigures:
    """A step's outcome read on the host."""

    loss: float
    grad_norm: float  # before clipping; NaN when an fp16 overflow skipped the step
    tokens: int
    overflow: bool

    @property
    def diverged(self) -> bool:
        """Skipped for a NaN/Inf gradient norm (not an fp16 overflow, which the loss scaler handles)."""
        return not self.overflow and not math.isfinite(self.grad_norm)

    @property
    def skipped(self) -> bool:
        return self.overflow or self.diverged


@dataclass
class StepResult:
    """A step's outcome, still on the device: reading it waits for the GPU to finish the step, so the training
    loop reads the steps since the last log step together, at log steps (`read_steps`: one wait)."""

    figures: torch.Tensor  # fp64: loss, gradient norm, tokens
    overflow: bool = False  # an fp16 loss-scale overflow skipped the step (fp16 votes on it on the host anyway)

    def read(self) -> StepFigures:
        return read_steps([self])[0]

    @property
    def tokens_on_device(self) -> torch.Tensor:
        """The global batch's count of loss tokens, not read to the host."""
        return self.figures[2]

    @property
    def loss(self) -> float:
        return self.read().loss


def read_steps(results: list[StepResult]) -> list[StepFigures]:
    """Every result on the host, with one device-to-host copy."""
    values = torch.stack([r.figures for r in results]).tolist() if results else []
    return [StepFigures(loss, norm, int(tokens), r.overflow) for (loss, norm, tokens), r in zip(values, results)]


def local_batches(trainer: Trainer, batches: list[Batch], training: bool = False) -> list[Batch]:
    """The micro batches on this rank's device, in `training` with multi-token prediction's targets where the
    model has it (cut from the whole sequences: data/mtp_targets.py; evaluation scores the next token only), cut
    to its part of every sequence under context parallelism."""
    t, depths = trainer.topology, trainer.cfg.model.mtp_num_layers
    batches = [b.to(t.device) for b in batches]
    if depths and training:
        batches = [replace(b, mtp=mtp_targets(b.labels, b.loss_mask, b.position_ids, depths)) for b in batches]
    if t.cp == 1:
        return batches
    positions = local_positions(trainer.cfg.model.seq_length, t.cp, t.cp_rank, t.device)
    return [b.select(positions) for b in batches]


def microbatch_forward(trainer: Trainer, batches: list[Batch],
                       on_last_chunk: Callable[[torch.Tensor, Batch], torch.Tensor]) -> ForwardStep:
    """The schedule's forward step, shared by training and evaluation: run model chunk `chunk` on micro
    batch `microbatch` in the configured precision; on the last chunk hand the per-token losses and the
    batch to `on_last_chunk`, whose result (what backward starts from, when training) is returned."""
    model, precision, device = trainer.model, trainer.cfg.train.precision, trainer.topology.device

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        batch = batches[microbatch]
        with precision_context(precision, device):
            out = model(batch.tokens, batch.labels, batch.position_ids, hidden=hidden, chunk=chunk, mtp=batch.mtp)
        return on_last_chunk(out, batch) if model.stage.is_last_chunk(chunk) else out

    return forward_step


def train_step(trainer: Trainer, batches: list[Batch]) -> StepResult:
    """One optimizer step of `trainer` over this rank's micro batches."""
    t, grads, optimizer, scaler = trainer.topology, trainer.grads, trainer.optimizer, trainer.scaler
    grads.zero()
    batches = local_batches(trainer, batches, training=True)
    positions = sum(b.loss_mask.numel() for b in batches) * t.dp_cp
    loss_sum = torch.zeros(1, device=t.device)

    def scaled_loss(out: torch.Tensor, batch: Batch) -> torch.Tensor:
        nonlocal loss_sum
        loss = (out * batch.loss_mask).sum() / positions
        loss_sum = loss_sum + loss.detach()
        return loss * scaler.scale

    trainer.model.aux_losses.start_step(scaler.scale / (len(batches) * t.dp_cp), t.device)  # as the loss's
    pipeline = trainer.pipeline
    forward_step = microbatch_forward(trainer, batches, scaled_loss)
    sharded = trainer.sharded_params
    run_schedule(pipeline.spec, len(batches), forward_step, pipeline.stage, pipeline.comm, pipeline.observers,
                 grads.start_sync, sharded.backward_done if sharded is not None else None, pipeline.pairs)
    if trainer.cfg.model.moe_expert_bias:
        update_expert_biases(trainer.model, t)
    grads.reduce(optimizer.grads_landed)
    optimizer.collect_grads()
    tokens = sum(b.loss_mask.sum(dtype=torch.float64) for b in batches).reshape(1)  # exact beyond 2^24 tokens
    totals = torch.cat((loss_sum.double(), tokens))
    if t.dp_cp > 1:  # a collective over one rank still hands off to the backend's thread, each step
        dist.all_reduce(totals, group=t.dp_cp_group)
    correction = (positions / totals[1].clamp(min=1.0)).float()
    loss, tokens = totals[0] * correction, totals[1]
    with optimizer.on_host():  # offloaded: this rank's share of the host's cores (main_weights.py)
        # Only fp16's dynamic loss scale can overflow; other precisions skip the check and its host-syncing vote.
        overflow = scaler.dynamic and optimizer.any_overflow(scaler.unscale_and_check(optimizer.grads()))
        scaler.update(overflow)
        if overflow:
            optimizer.finish_step()
            return StepResult(torch.stack((loss, torch.full_like(loss, math.nan), tokens)), overflow=True)
        grad_norm = optimizer.clip(trainer.cfg.optim.clip_grad, correction)
        optimizer.step()  # no update where the (global, so every rank's) norm is NaN/Inf: decided on the device
    return StepResult(torch.stack((loss, grad_norm.double().to(loss.device), tokens)))
