"""Auxiliary loss terms a layer adds in its forward (a mixture of experts' load-balancing and z-losses),
reaching backward on whatever pipeline stage the layer runs, without the schedules knowing.

A pipeline stage in the middle differentiates only the hidden states it hands on; no loss of its own ever
reaches `backward`. So, as Megatron-LM's MoEAuxLossAutoScaler does, the term is attached to the layer's
output by an autograd function that is the identity in forward and, in backward, passes the output's
gradient through and gives the term the gradient `scale`: the term joins the loss exactly where the
layer's backward runs. `scale` is set by the training step to what the main loss is multiplied by per
micro batch (loss scale / (micro batches x data-parallel ranks)), so the term is averaged over the global
batch like the loss. Each term's detached values are summed per name for logging (`totals`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _Attached(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.shape, ctx.dtype = loss.shape, loss.dtype
        return output.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.dtype).expand(ctx.shape).clone(), None


class AuxLosses:
    """The model's auxiliary loss terms of the current step, the gradient scale the step gives them, and what the
    routers saw (tokens per expert, by layer) for logging. A layer's forward rerun by activation recompute
    (inside `replaying()`) attaches its terms again for backward but counts nothing twice."""

    def __init__(self) -> None:
        self.scale = torch.ones(())
        self.totals: dict[str, torch.Tensor] = {}
        self.loads: dict[int, torch.Tensor] = {}  # layer index -> tokens routed to each expert this step
        self.dropped: torch.Tensor | None = None  # pairs the experts' capacity dropped this step
        self.replaying_forward = False

    def attach(self, name: str, output: torch.Tensor, loss: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """A copy of `output` carrying `loss` (a scalar) times `weight` into backward; `loss` counted under `name`
        for logging. Attach to a small tensor the layer goes on computing with (a router's probabilities, as
        Megatron-LM does): a copy, not a view, so that it is safe even on a tensor a pipeline stage sends and then
        frees."""
        if not self.replaying_forward:
            self.totals[name] = _added(self.totals.get(name), loss.detach().float())
        if not torch.is_grad_enabled() or not loss.requires_grad:
            return output
        return _Attached.apply(output, loss, self.scale if weight == 1.0 else self.scale * weight)

    def record_load(self, layer: int, counts: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
        """Layer `layer` routed `counts` of this rank's (token, choice) pairs to each expert, and its experts'
        capacity dropped `dropped` of them."""
        if not self.replaying_forward:
            self.loads[layer] = _added(self.loads.get(layer), counts.detach().float())
            if dropped is not None:
                self.dropped = _added(self.dropped, dropped.detach().float())

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """A forward run again for activation recompute: nothing it reports is counted."""
        self.replaying_forward = True
        try:
            yield
        finally:
            self.replaying_forward = False

    def start_step(self, scale: float, device: torch.device) -> None:
        """A new step: its terms get gradient `scale` each (filled on `device`, not copied from the host), and
        the totals and loads start from zero."""
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)
        self.totals, self.loads, self.dropped = {}, {}, None


def _added(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value
