"""What a module costs, declared beside its code, read from a model built on the meta device.

The planner (planning/) and the FLOPs count (training/flops.py) build the real model of a rank, or of one
device, on the meta device and ask its modules; they keep no description of layer shapes of their own. A
module declares what it costs with plain methods, any of them (one it leaves out costs what its children's
add up to, parameters of its own aside):
- `saved_bytes(batch)`: what its forward keeps for backward, per micro batch (`batch`), children included;
- `held_bytes(batch)`: what its weight gradients read in a zero-bubble schedule's W, held from the B that
  queued them until then (parallel/weight_grads.py): never a parameter;
- `matmul_parameters()`: the weights one token multiplies (2 FLOPs each forward, 4 backward);
- `attention_flops(seq)`: other forward FLOPs per token (attention's s x s square, or what a window keeps of it);
- `recomputed_flops(seq)`: the forward FLOPs per token its backward runs again (activation recompute);
- `active_parameters()`: the parameters one token uses (experts it is not routed to aside);
- `transient_bytes(batch)`: what it holds for a moment beyond what it saves (the loss's temporaries);
- `backward_transient_bytes(batch)`: what its backward holds at its worst moment beyond what its forward saved
  (the MoE combine's fp32 gradients of the routed rows).
Sizes are those of the module as built (its weights' shapes are this rank's shards), its recompute flags as
model/recompute.py set them, and the batch's: tokens, dtype widths, the device kind whose kernels run (CUDA's
fused RMSNorm keeps other tensors than a CPU's). What depends on the data, how many rows each expert runs, is
the planner's assumption, balanced routing, declared by the dispatchers (model/moe/dispatch.py).

A new layer type is planned by declaring these next to its forward; nothing in planning/ names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MicroBatch:
    """One micro batch on one rank, as the module declarations read it."""

    tokens: int  # this rank's tokens of it: seq/cp x micro batch (what attention and gathered matmuls see)
    rows: int  # rows of the residual stream: tokens/tp under sequence parallelism, else tokens
    compute: int  # bytes per element of the compute dtype (train.precision: autocast)
    residual: int  # bytes per element of the parameters' dtype (the residual stream between layers)
    device: str = "cuda"  # the device kind whose kernels run: "cuda" or "cpu"

    @property
    def autocast(self) -> bool:
        return self.compute != 4


def _walk(module: nn.Module, name: str, *args: object) -> float:
    """The module's own declaration `name`, else the sum of its children's."""
    declared = getattr(module, name, None)
    if declared is not None:
        return declared(*args)
    return sum(_walk(child, name, *args) for child in module.children())


def saved_bytes(module: nn.Module, batch: MicroBatch) -> int:
    return _walk(module, "saved_bytes", batch)


def held_bytes(module: nn.Module, batch: MicroBatch) -> int:
    return _walk(module, "held_bytes", batch)


def transient_bytes(module: nn.Module, batch: MicroBatch) -> int:
    return _walk(module, "transient_bytes", batch)


def backward_transient_bytes(module: nn.Module, batch: MicroBatch) -> int:
    return _walk(module, "backward_transient_bytes", batch)


def matmul_parameters(module: nn.Module) -> int:
    return _walk(module, "matmul_parameters")


def attention_flops(module: nn.Module, seq: int) -> float:
    return _walk(module, "attention_flops", seq)


def recomputed_flops(module: nn.Module, seq: int) -> float:
    return _walk(module, "recomputed_flops", seq)


def forward_flops(module: nn.Module, seq: int) -> float:
    """Forward FLOPs per token: every weight multiplied (2 FLOPs) and the attention square."""
    return 2 * matmul_parameters(module) + attention_flops(module, seq)


def active_parameters(module: nn.Module) -> int:
    """Parameters one token uses: each module's own, or what it declares (routed experts: the top-k)."""
    declared = getattr(module, "active_parameters", None)
    if declared is not None:
        return declared()
    own = sum(p.numel() for p in module.parameters(recurse=False))
    return own + sum(active_parameters(child) for child in module.children())


def matmul_held(weight: nn.Parameter, rows: int, width: int) -> int:
    """A matmul's weight-gradient inputs: its input [rows, in] and output gradient [rows, out] (a grouped GEMM's
    weight is [experts, out, in]), `width` bytes per element."""
    out_features, in_features = weight.shape[-2:]
    return rows * (in_features + out_features) * width


def kept_input_bytes(linear: nn.Module, rows: int, width: int) -> int:
    """What a linear keeps of its input, `rows` rows of `width` bytes per element, for its weight gradient: as its
    recipe keeps it (parallel/gemm.py Recipe.kept_input_bytes: x itself, or under FP8 `tensorwise` an FP8 copy and
    its scale)."""
    return linear.recipe.kept_input_bytes(rows, linear.weight.shape[1], width)


def linear_held(linear: nn.Module, rows: int, width: int) -> int:
    """`matmul_held` of a linear whose input is kept as its recipe keeps it (`kept_input_bytes`)."""
    return kept_input_bytes(linear, rows, width) + rows * linear.weight.shape[0] * width


def weights_multiplied(*linears: nn.Module) -> int:
    """The weights of these linear layers, each multiplied once per token."""
    return sum(linear.weight.numel() for linear in linears)


def row_bias_held(linear: nn.Module, batch: MicroBatch) -> int:
    """A row-parallel layer's bias under tensor parallelism is added after the reduction, outside the matmul: its
    weight gradient holds that addition's input and output gradient."""
    if linear.bias is None or linear.ctx.tp.size == 1:
        return 0
    return 2 * batch.rows * linear.weight.shape[0] * batch.compute
