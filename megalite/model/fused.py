"""SwiGLU and RoPE as autograd Functions whose forward and backward are each one pointwise function, compiled
by torch.compile into one kernel each way on CUDA (as Megatron-Core fuses bias-SwiGLU and RoPE), and torch's
eager ops elsewhere. train.fusions (on by default) picks these, and norms run in their input's dtype under
autocast (model/norms.py); off, the model runs the eager forms (model/mlp.py `activate`, model/rope.py
`apply_rope`) under plain autograd, and norms as autocast has them. The routed experts keep the eager form:
their row counts change every step, which a compiled kernel would follow with recompiles.

Why (Llama-3.2-1B on an H200, fp32 parameters under bf16 autocast, 373 ms a step): eager, silu and the product
read the gate and up halves of fc1's fused output in place, every row strided by twice their width, so torch
runs its unvectorised kernels, and autograd concatenates their gradients (about 29 ms together); RoPE's rotate
half is a negation, a concatenation, two fp32 products, a sum and a cast forward, and backward twice as many
kernels, zero-filled slices and adds among them (about 15 ms).

The values are the eager forms': uncompiled, every output is bit for bit eager's, and so is every gradient in
fp32 (RoPE's bf16 gradient is rounded once from fp32, where autograd rounded three times). Compiled, inductor
computes each in fp32 and rounds once, so a bf16 result may differ from eager's in its last bit.
What autograd keeps: SwiGLU its input (gate | up) and recomputes silu in backward, where eager autograd kept
silu(gate) too (a third less of the MLP's activations); RoPE only its cos and sin tables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The gradient of h = [gate | up], as autograd takes it through silu, the product and the chunk."""
    gate, up = h.chunk(2, dim=-1)
    return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in fp32 (the tables' dtype), rounded once to x's dtype."""
    half = x.shape[-1] // 2
    return (x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin).to(x.dtype)


def _rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half's transpose takes [a | b] to [b | -a]: grad * cos + that of grad * sin (the halves of sin are
    equal), in fp32, rounded once to grad's dtype."""
    half = grad.shape[-1] // 2
    return (grad * cos + torch.cat((grad[..., half:], -grad[..., :half]), dim=-1) * sin).to(grad.dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


@functools.cache
def _can_compile() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def _kernel(fn: Callable, x: torch.Tensor) -> Callable:
    """fn compiled on CUDA (where triton is there to compile it); as it is elsewhere, and inside a compiled layer
    (train.compile), which fuses it with the rest of the layer."""
    compile_here = x.is_cuda and not torch.compiler.is_compiling() and _can_compile()
    return _compiled(fn) if compile_here else fn


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return _kernel(_swiglu, h)(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return _kernel(_swiglu_backward, h)(grad, h)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _kernel(_rope, x)(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _kernel(_rope_backward, grad)(grad, cos, sin), None, None


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h = [gate | up] (model/mlp.py `activate` with silu, gated)."""
    return _SwiGLU.apply(h)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """model/rope.py `apply_rope`: x [seq, batch, heads, head_dim], fp32 cos and sin broadcastable to it."""
    return _RoPE.apply(x, cos, sin)


def apply_fusions(model: nn.Module, enabled: bool) -> None:
    """train.fusions on a built model: each module that offers fusions (its `fused` flag) takes them or not."""
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = enabled
