"""The one matmul hook: every linear layer's y = x W^T + b runs through `linear` here, and its backward
through three named functions: `forward`, `input_grad` and `weight_grad`.

`weight_grad` adds dW straight into the parameter's main gradient when a gradient buffer holds it
(the buffer gives the parameter an `accumulate_grad` sink, grad_buffer.py): Megatron-LM's gradient-
accumulation fusion. No dW temporary is made and handed to autograd to add, and under bf16 autocast the
product of bf16 operands is accumulated in fp32, not rounded to bf16 first (on CUDA by cuBLAS with an
fp32 output; a CPU has no mixed-dtype GEMM, so there the operands are widened). Without a buffer (a bare
model, a test) dW goes into `weight.grad`. The weight and bias gradients are handed to
weight_grads.weight_grad, which computes them at once or, inside a zero-bubble schedule's B, in its W
(weight_grads.py); FP8 matmuls plug in here too.

Under sequence parallelism a column-parallel layer's input is all-gathered along the sequence; only the
local shard is kept for backward and gathered again there, overlapped with the input gradient's matmul,
and the input gradient's reduce-scatter is launched before the weight gradient's matmul and awaited after
it, so the two overlap: Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication (a deferred weight
gradient keeps the gathered input until its W instead). On CUDA the overlap needs
CUDA_DEVICE_MAX_CONNECTIONS=1 (cuda_env.py), which makes the GPU start kernels and collectives in the order
they were queued. Under torch.compile the backward runs behind weight_grads.split_backward's opaque op, so
the sink and the split work there too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel.mappings import all_gather_single, gather_rows, in_compute_dtype, start_reduce_scatter_rows
from megalite.parallel.weight_grads import split_backward
from megalite.parallel.weight_grads import weight_grad as defer_weight_grad


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b in x's dtype (the compute dtype under autocast: the weights are cast as autocast would)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.matmul(weight.to(grad.dtype))


_CPU_CAST_BYTES = 64 * 2**20  # the fp32 copies of grad and x rows a CPU makes at once (see _accumulate)


def _accumulate(main: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """main += grad^T x, for [n, out] grad and [n, in] x, accumulated in main's dtype. A CPU has no mixed-dtype
    addmm, so it casts rows of grad and x to main's dtype a few at a time: whole, the LM head's [tokens, vocab]
    gradient would be copied at once (llama_8b_zero3: 47 GiB, found by the dry run), where CUDA's kernel copies
    nothing."""
    if grad.dtype == main.dtype:
        main.addmm_(grad.t(), x)
    elif main.is_cuda:
        torch.addmm(main, grad.t(), x, out_dtype=main.dtype, out=main)
    else:
        rows = max(1, _CPU_CAST_BYTES // (main.element_size() * (grad.shape[1] + x.shape[1])))
        for start in range(0, grad.shape[0], rows):
            main.addmm_(grad[start : start + rows].t().to(main.dtype), x[start : start + rows].to(main.dtype))


def weight_grad(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, final: bool = True) -> torch.Tensor | None:
    """dW = grad^T x for [..., out] grad and [..., in] x: added into the main gradient when the parameter has a
    sink and this is its `final` gradient of the backward (returns None), else returned in the weight's dtype.
    A non-final one that the sink adds in later (the tied LM head's, waiting in `weight.grad`) is accumulated
    in the weight's dtype as the sink would, not rounded to the compute dtype first. Reads the weight's shape
    and dtype, never its values."""
    grad, x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    sink = getattr(weight, "accumulate_grad", None)
    if sink is None:
        return grad.t().matmul(x.to(grad.dtype)).to(weight.dtype)
    if not final:
        waiting = torch.zeros(weight.shape, dtype=weight.dtype, device=grad.device)
        _accumulate(waiting, grad, x)
        return waiting
    sink(lambda main: _accumulate(main.view(weight.shape), grad, x))
    return None


def bias_grad(bias: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: dist.ProcessGroup | None, final: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.params = (weight,) if bias is None else (weight, bias)  # on ctx: a checkpoint's recompute would save copies
        ctx.group, ctx.final = group, final
        return forward(x if group is None else gather_rows(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        needs = tuple(ctx.needs_input_grad[:3])
        (x,) = ctx.saved_tensors
        grad_input = split_backward(_linear_backward, [x, grad.contiguous(), *ctx.params], group=ctx.group,
                                    final=ctx.final, needs=needs)
        return (grad_input if needs[0] else None), None, None, None, None


def _linear_backward(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     group: dist.ProcessGroup | None, final: bool, needs: tuple[bool, bool, bool]) -> torch.Tensor:
    """The input gradient, returned; the weight and bias gradients, handed to weight_grads (at once, or in W).
    Under sequence parallelism x is this rank's rows: gathered again here, overlapped with the input gradient's
    matmul, whose reduce-scatter overlaps the weight gradient's when that runs now."""
    gathering = None
    if group is not None:
        whole = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gathering = all_gather_single(whole, x.contiguous(), group, async_op=True)
    grad_input = input_grad(grad, weight) if needs[0] else torch.empty_like(x)  # overlaps the gather
    if gathering is not None:
        gathering.wait()
        x = whole
    scattering = None
    if group is not None and needs[0]:  # launched first, so it overlaps the dW matmul
        grad_input, scattering = start_reduce_scatter_rows(grad_input, group)
    if needs[1]:
        defer_weight_grad(weight, lambda: weight_grad(weight, grad, x, final), final)
    if bias is not None and needs[2]:
        defer_weight_grad(bias, lambda: bias_grad(bias, grad))
    if scattering is not None:
        scattering.wait()
    return grad_input


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gather_group: dist.ProcessGroup | None = None, final: bool = True) -> torch.Tensor:
    """x W^T + b in the compute dtype; `gather_group`: all-gather x along its first (sequence) dimension over
    it first (a column-parallel layer under sequence parallelism). `final=False` for a weight that gets more
    gradient later in the same backward (the LM head reading the tied embedding in its chunk): the gradient
    buffer must count each parameter once per backward, after all of its gradient is in."""
    if gather_group is not None and dist.get_world_size(gather_group) == 1:
        gather_group = None
    return _Linear.apply(in_compute_dtype(x), weight, bias, gather_group, final)
