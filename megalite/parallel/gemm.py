"""The one matmul hook: every linear layer's y = x W^T + b runs through `linear` here, and its backward
through three named functions: `forward`, `input_grad` and `weight_grad`.

`weight_grad` adds dW straight into the parameter's main gradient when a gradient buffer holds it
(the buffer gives the parameter an `accumulate_grad` sink, grad_buffer.py): Megatron-LM's gradient-
accumulation fusion. No dW temporary is made and handed to autograd to add, and under bf16 autocast the
product of bf16 operands is accumulated in fp32, not rounded to bf16 first (on CUDA by cuBLAS with an
fp32 output; a CPU has no mixed-dtype GEMM, so there the operands are widened). Without a buffer (a bare
model, a test) dW is returned to autograd as usual. FP8 matmuls and the zero-bubble schedules' deferred
weight gradient (their W operation) plug in here.

Under sequence parallelism a column-parallel layer's input is all-gathered along the sequence; only the
local shard is kept for backward and gathered again there, overlapped with the input gradient's matmul,
and the input gradient's reduce-scatter is launched before the weight gradient's matmul and awaited after
it, so the two overlap: Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication. On CUDA the
overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1 (cuda_env.py), which makes the GPU start kernels and
collectives in the order they were queued. Under torch.compile the weight gradient is returned to autograd
(a Python sink called from backward would break the compiled graph); the buffer's hook then adds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel.mappings import all_gather_single, gather_rows, in_compute_dtype, start_reduce_scatter_rows


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b in x's dtype (the compute dtype under autocast: the weights are cast as autocast would)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.matmul(weight.to(grad.dtype))


def _accumulate(main: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """main += grad^T x, for [n, out] grad and [n, in] x, accumulated in main's dtype."""
    if grad.dtype == main.dtype:
        main.addmm_(grad.t(), x)
    elif main.is_cuda:
        torch.addmm(main, grad.t(), x, out_dtype=main.dtype, out=main)
    else:
        main.addmm_(grad.t().to(main.dtype), x.to(main.dtype))


def weight_grad(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, fuse: bool = True) -> torch.Tensor | None:
    """dW = grad^T x for [..., out] grad and [..., in] x: added into the main gradient when the parameter has a
    sink and `fuse` (returns None), else returned in the weight's dtype."""
    grad, x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    sink = getattr(weight, "accumulate_grad", None) if fuse else None
    if sink is None:
        return grad.t().matmul(x.to(grad.dtype)).to(weight.dtype)
    sink(lambda main: _accumulate(main.view(weight.shape), grad, x))
    return None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: dist.ProcessGroup | None, fuse: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.group, ctx.fuse = group, fuse and not torch.compiler.is_compiling()
        return forward(x if group is None else gather_rows(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        gathering = None
        if ctx.group is not None:
            whole = torch.empty((dist.get_world_size(ctx.group) * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                                device=x.device)
            gathering = all_gather_single(whole, x.contiguous(), ctx.group, async_op=True)
        grad_input = input_grad(grad, weight) if ctx.needs_input_grad[0] else None  # overlaps the gather
        if gathering is not None:
            gathering.wait()
            x = whole
        scattering = None
        if ctx.group is not None and grad_input is not None:  # launched first, so it overlaps the dW matmul
            grad_input, scattering = start_reduce_scatter_rows(grad_input, ctx.group)
        grad_weight = weight_grad(weight, grad, x, ctx.fuse) if ctx.needs_input_grad[1] else None
        grad_bias = None if bias is None else grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)
        if scattering is not None:
            scattering.wait()
        return grad_input, grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gather_group: dist.ProcessGroup | None = None, fuse: bool = True) -> torch.Tensor:
    """x W^T + b in the compute dtype; `gather_group`: all-gather x along its first (sequence) dimension over
    it first (a column-parallel layer under sequence parallelism). `fuse=False` for a weight that also gets
    gradient elsewhere through autograd (the LM head reading the tied embedding on its stage): the gradient
    buffer must hear of each parameter once per backward, after all of its gradient is in."""
    if gather_group is not None and dist.get_world_size(gather_group) == 1:
        gather_group = None
    return _Linear.apply(in_compute_dtype(x), weight, bias, gather_group, fuse)
