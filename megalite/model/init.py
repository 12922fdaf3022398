"""Megatron-style initialisation that depends only on the seed and each parameter's name.

Every parameter draws from its own generator, seeded from (seed, global name), and is
drawn at its full (unsharded) shape. A model split over any parallel layout therefore
holds exactly the slices of the one-device model, which is what makes parity testable
and lets a run change its layout without changing its numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.placement import Coord, Placement
from megalite.parallel.random import named_seed

_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
# What each full-shape draw runs inside (`draws_inside`); none by default.
_DRAW_CONTEXT: ContextVar[Callable[[], contextlib.AbstractContextManager] | None] = ContextVar("draw", default=None)


@contextlib.contextmanager
def draws_inside(context: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Inside the block, every parameter's full-shape initial value is drawn inside `context()`: the seam through
    which the dry run counts the draws as host memory (dryrun/rank_step.py), since they are made on the CPU
    whatever the device."""
    token = _DRAW_CONTEXT.set(context)
    try:
        yield
    finally:
        _DRAW_CONTEXT.reset(token)


def initial_value(name: str, shape: torch.Size, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The fp32 initial value of parameter `name` at its full shape, on the CPU."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = cfg.init_std / math.sqrt(2 * cfg.num_layers) if name.endswith(_OUTPUT_PROJECTIONS) else cfg.init_std
    generator = torch.Generator().manual_seed(named_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, cfg: ModelConfig, placements: dict[str, Placement], coord: Coord,
                    tied_copies: dict[str, str]) -> None:
    """Fill every parameter with this rank's slice (its placement's) of the full initial value; a tied copy
    ({copy name: original name}) takes the value of the one-device parameter it copies. Buffers (a router's
    expert bias) start at zero."""
    draw = _DRAW_CONTEXT.get() or contextlib.nullcontext
    for local_name, param in model.named_parameters():
        placement, name = placements[local_name], tied_copies.get(local_name, local_name)
        with draw():
            full = initial_value(name, torch.Size(placement.global_shape(param.shape, coord)), seed, cfg)
        param.copy_(placement.local(full, coord))
        del full  # before the next draw: one full-shape tensor in host memory at a time, not two (the dry run)
    for buffer in model.buffers():
        buffer.zero_()
