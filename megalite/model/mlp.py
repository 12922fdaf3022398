"""The feed-forward block: activation(fc1(x)), or gated, activation(gate) * up (SwiGLU with silu, as Llama),
then fc2. The activation (model.activation) is GELU's tanh approximation (GPT-2), exact GELU (Megatron-LM's
GPT), SiLU or x * sigmoid(1.702 x) (quick GELU); the routed experts (model/moe/experts.py) apply it the same way.
gpt-oss's gated experts clamp first (model.glu_limit: the gate at most 7, up within [-7, 7]) and multiply by
up + 1 (model.glu_linear_offset), as Megatron-Core's activation_func_clamp_value and glu_linear_offset do.

A gated MLP's gate and up projections are one fused matrix, gate rows first then up rows;
tensor parallelism splits each half separately so every rank holds matching slices.

Its costs (model/costs.py): fc1 keeps its input (this rank's rows under SP); the activation keeps fc1's output
and what it makes, for every local token (column-parallel layers gather them under SP): gate|up, silu(gate)
and the product (fc2's input) when gated (fused SwiGLU recomputes silu(gate)), the GELU input and output
otherwise (`activation_bytes`). fc1's and fc2's inputs are kept as their recipe keeps them (FP8 `tensorwise`:
an FP8 copy).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import Features, ModelConfig
from megalite.model.costs import MicroBatch, kept_input_bytes, linear_held, row_bias_held, weights_multiplied
from megalite.model.fused import swiglu
from megalite.parallel.context import ParallelContext
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
               "quick_gelu": _quick_gelu}


def activate(h: torch.Tensor, features: Features, fused: bool = False) -> torch.Tensor:
    """fc1's output -> fc2's input: activation(h), or with a gated MLP activation(gate) * (up + offset) of
    h = [gate | up], both clamped first when the features have a limit; `fused`: plain SwiGLU as model/fused.py's
    one kernel each way."""
    activation = ACTIVATIONS[features.activation]
    if not features.gated_mlp:
        return activation(h)
    if fuses_swiglu(features, fused):
        return swiglu(h)
    gate, up = h.chunk(2, dim=-1)
    if features.glu_limit is not None:
        gate, up = gate.clamp(max=features.glu_limit), up.clamp(-features.glu_limit, features.glu_limit)
    if features.glu_linear_offset:
        up = up + features.glu_linear_offset
    return activation(gate) * up


def fuses_swiglu(features: Features, fused: bool) -> bool:
    """Whether `activate` runs model/fused.py's SwiGLU: asked to fuse, and a plain SwiGLU (no clamp, no offset)."""
    return (fused and features.gated_mlp and features.activation == "silu" and features.glu_limit is None
            and not features.glu_linear_offset)


def activation_bytes(features: Features, fused: bool, rows: int, width: int, compute: int) -> int:
    """What `activate` keeps for `rows` rows of an MLP `width` wide (this rank's share), fc1's output and fc2's input
    among them, in the compute dtype. Ungated: fc1's output and the activation's (quick GELU's sigmoid too).
    Fused SwiGLU: gate|up and the product. Otherwise gated: gate|up, the activation's output (and quick GELU's
    sigmoid), the product, and each half the clamp or the offset made anew (the clamped gate, the new up)."""
    quick = features.activation == "quick_gelu"
    if not features.gated_mlp:
        units = 2 + quick
    elif fuses_swiglu(features, fused):
        units = 3
    else:
        clamped, offset = features.glu_limit is not None, bool(features.glu_linear_offset)
        units = 2 + 1 + 1 + quick + clamped + (clamped or offset)
    return units * rows * width * compute


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, width: int | None = None) -> None:
        """`width`: the hidden width (default: the model's MLP width; a shared expert's is its own)."""
        super().__init__()
        features = self.features = cfg.features
        blocks, width = 2 if features.gated_mlp else 1, width or cfg.ffn_size
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, blocks * width, ctx, features.bias, blocks=blocks)
        self.linear_fc2 = RowParallelLinear(width, cfg.hidden_size, ctx, features.bias)
        self.fused = True  # train.fusions (model/fused.py apply_fusions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(self.linear_fc1(x), self.features, self.fused))

    def saved_bytes(self, batch: MicroBatch) -> int:
        return kept_input_bytes(self.linear_fc1, batch.rows, batch.compute) + self.activation_bytes(batch)

    def activation_bytes(self, batch: MicroBatch) -> int:
        """What the MLP keeps past its input: fc1's output and the activation's tensors, and fc2's input, which
        only fc2 keeps: as its recipe keeps it."""
        width = self.linear_fc2.weight.shape[1]  # this rank's share of the hidden width
        fc2_input = batch.tokens * width * batch.compute
        return (activation_bytes(self.features, self.fused, batch.tokens, width, batch.compute) - fc2_input
                + kept_input_bytes(self.linear_fc2, batch.tokens, batch.compute))

    def held_bytes(self, batch: MicroBatch) -> int:
        return self.matmuls_held(batch.tokens, batch.compute) + row_bias_held(self.linear_fc2, batch)

    def matmuls_held(self, tokens: int, width: int) -> int:
        """fc1's and fc2's input and output gradient for `tokens` tokens, `width` bytes per element."""
        return linear_held(self.linear_fc1, tokens, width) + linear_held(self.linear_fc2, tokens, width)

    def matmul_parameters(self) -> int:
        return weights_multiplied(self.linear_fc1, self.linear_fc2)
