"""What a Megatron-LM checkpoint holds, once read: the same for both formats."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN = "main"  # the optimizer's fp32 main weights (distributed optimizer, or bf16/fp16 training)


@dataclass
class MegatronState:
    """`weights`: whole (tensor-parallel merged) tensors by Megatron's name, layers numbered globally from 0
    ("decoder.layers.5.mlp.linear_fc1.weight"); `optimizer`: the same names -> {exp_avg, exp_avg_sq and, where
    the checkpoint has them, main}, empty without optimizer state; `adam_step`: Adam's step count."""

    path: Path
    args: argparse.Namespace
    iteration: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    adam_step: int | None = None


def arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """Megatron's `args.<name>`, or `default` where the Megatron version that saved them had no such argument."""
    return getattr(args, name, default)
