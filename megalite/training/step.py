"""One optimizer step: forward/backward over the micro batches, gradient reduction across
data-parallel replicas, unscale and overflow check, clipping, and the update.

Each micro batch's loss is its summed token loss divided by the token count of the whole
global batch (all data-parallel ranks together), so the gradient and the reported loss
are the global batch's per-token mean in every layout, loss masks included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.data.batches import Batch
from megalite.parallel.grads import GradientReducer
from megalite.parallel.topology import Topology
from megalite.training.loss_scaler import LossScaler

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in _AUTOCAST:
        return torch.autocast(device.type, dtype=_AUTOCAST[precision])
    return contextlib.nullcontext()


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    tokens: int


def global_token_count(batches: list[Batch], topology: Topology) -> torch.Tensor:
    count = sum(b.loss_mask.sum() for b in batches).to(topology.device, torch.float32).reshape(1)
    dist.all_reduce(count, group=topology.dp_group)
    return count


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler, reducer: GradientReducer,
               batches: list[Batch], topology: Topology, precision: str, clip_grad: float) -> StepResult:
    optimizer.zero_grad(set_to_none=False)
    total_tokens = global_token_count(batches, topology)
    loss_sum = torch.zeros(1, device=topology.device)
    for batch in batches:
        batch = batch.to(topology.device)
        with precision_context(precision, topology.device):
            losses = model(batch.tokens, batch.labels, batch.position_ids)
        loss = (losses * batch.loss_mask).sum() / total_tokens
        (loss * scaler.scale).backward()
        loss_sum += loss.detach()
    reducer.reduce()
    dist.all_reduce(loss_sum, group=topology.dp_group)
    overflow = reducer.any_overflow(scaler.unscale_and_check(reducer.grads()))
    scaler.update(overflow)
    if overflow:
        return StepResult(float(loss_sum), float("nan"), True, int(total_tokens.item()))
    grad_norm = reducer.clip(clip_grad)
    if not torch.isfinite(torch.tensor(grad_norm)) and not scaler.dynamic:
        raise FloatingPointError(f"gradient norm is {grad_norm} (loss {float(loss_sum)}): training diverged; lower optim.lr or resume from an earlier checkpoint")
    optimizer.step()
    return StepResult(float(loss_sum), grad_norm, False, int(total_tokens.item()))
