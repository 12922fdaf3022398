"""Weight gradients, computed inside a layer's backward or deferred to a later W operation.

A zero-bubble schedule (parallel/pipeline/zero_bubble.py) splits each chunk's backward in two: B computes the input
gradients, which the previous pipeline rank waits for, and W, later, the weight gradients, which nothing
waits for, so they can fill the pipeline's bubbles (Qi et al., arXiv 2401.10241). Every layer hands its
parameters' gradients to `deliver` here from its own backward: inside a B (`deferred`) the work is
queued, holding what it reads (the layer's input and output gradient, never the parameter's value), and W
runs the queue in the order B queued it; outside a B it runs at once, and the backward is the fused one.
Either way the same functions compute the same numbers: B followed by W equals the fused backward, bit for
bit. megalite's layers never hand a weight gradient to autograd.

Where a gradient goes is the one deposit path, `_deposit`: into the sink of the gradient buffer the parameter
belongs to (`GradSink`, grad_buffer.py), which adds it into the parameter's main gradient (a matmul adds dW
there directly, accumulating in the main gradient's dtype: gemm.py); without a buffer (a bare model, a test)
into `param.grad`, as autograd would.

Two kinds of layer split their backward:
- matmuls (gemm.py: linear layers, the LM head with its cross-entropy, the experts' grouped GEMM): their
  backward already has an input-gradient and a weight-gradient function; W runs the second on the kept
  input and output gradient;
- `recomputed`: layers whose weight gradient is cheap but comes out of the same autograd node as the input
  gradient (norms, a bias added after a reduction). Forward keeps only the input; backward runs the layer
  again under autograd, for the input gradient alone (B) and, in W, for the parameters alone, from stand-in
  parameters: these layers are affine in each parameter, so its gradient does not depend on its value, and
  W reads no parameter (ZeRO-3 has freed them by then).

The queue of the B under way is module state (`_queue`), set only inside `deferred`: autograd may run a
backward on a worker thread (one per CUDA device), which must see it too. Under torch.compile a layer's
backward is traced ahead of time, so whether it defers cannot be decided there: `opaque_backward` puts the
backward's work behind one opaque custom op that decides when it runs, so compiled layers split too
(torch.distributed.pipelining refuses compiled stages for want of this).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

_queue: WeightGradients | None = None  # the B under way: where weight gradients go instead of being computed

Compute = Callable[[], torch.Tensor | None]  # a parameter's gradient as a new tensor in its dtype (None: none)
Accumulate = Callable[[torch.Tensor], None]  # adds a parameter's gradient into the tensor it is given


class GradSink(Protocol):
    """Where the gradients of a gradient buffer's parameters go (grad_buffer.py GradBuffer): `add(target)` adds one
    reader's gradient of `param` into the target the sink chooses, a tensor of the parameter's shape (its main
    gradient, or what waits there for the parameter's other readers in the same backward)."""

    def deposit(self, param: torch.Tensor, add: Accumulate) -> None: ...


def set_sink(param: torch.Tensor, sink: GradSink) -> None:
    """`param` belongs to `sink`'s buffer: its gradients go there (a gradient buffer calls this for its own)."""
    param.grad_sink = sink


def sink_of(param: torch.Tensor) -> GradSink | None:
    """The sink of the buffer `param` belongs to; None without one."""
    return getattr(param, "grad_sink", None)


class WeightGradients:
    """The weight-gradient work of one B (one model chunk, one micro batch), run by its W."""

    def __init__(self) -> None:
        self.work: list[tuple[torch.Tensor, Compute, Accumulate | None]] = []

    @torch.no_grad()
    def run(self) -> None:
        """Compute every queued gradient, in the order B queued it, into the parameters' gradients (as a
        backward would: recording nothing for autograd)."""
        work, self.work = self.work, []
        for param, compute, accumulate in work:
            _deposit(param, compute, accumulate)


@contextlib.contextmanager
def deferred(queue: WeightGradients) -> Iterator[WeightGradients]:
    """Inside: a B. Weight gradients are queued on `queue`, not computed."""
    global _queue
    previous, _queue = _queue, queue
    try:
        yield queue
    finally:
        _queue = previous


def deliver(param: torch.Tensor, compute: Compute, accumulate: Accumulate | None = None) -> None:
    """Give `param` a gradient, now or, inside a B, in its W: the one compute() returns, or, where `param`
    belongs to a gradient buffer and `accumulate` is given, the one accumulate(target) adds into the target the
    buffer chooses (a matmul's dW, accumulated in the main gradient's dtype without a temporary)."""
    if _queue is not None:
        _queue.work.append((param, compute, accumulate))
    else:
        _deposit(param, compute, accumulate)


def _deposit(param: torch.Tensor, compute: Compute, accumulate: Accumulate | None) -> None:
    """The one deposit path: through the sink of `param`'s buffer, else into `param.grad` as autograd would."""
    sink = sink_of(param)
    if sink is not None and accumulate is not None:
        sink.deposit(param, accumulate)
        return
    grad = compute()  # before the sink is asked for a target (ZeRO-2/3 make a bucket's storage then)
    if grad is None:
        return
    if sink is not None:
        sink.deposit(param, lambda target: target.add_(grad.view(target.shape)))
    else:
        param.grad = grad if param.grad is None else param.grad + grad


def recomputed(fn: Callable[..., torch.Tensor], x: torch.Tensor, *params: torch.Tensor, **static: Any) -> torch.Tensor:
    """fn(x, *params, **static), keeping only x for backward, which runs fn again under autograd: the input
    gradient at once, the parameters' gradients through `deliver` (in W inside a B). fn must be affine in
    each parameter (norm scales and shifts, biases): their gradients come from stand-ins, not their values.
    `fn` is a module-level function and `static` hashable, so that a compiled backward can name them."""
    return _Recomputed.apply(x, fn, static, *params)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[..., torch.Tensor], static: dict[str, Any],
                *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.params = params  # on ctx, not saved: a checkpoint's recompute would save copies, not the parameters
        ctx.fn, ctx.static = fn, static
        ctx.autocast = autocast_state(x.device.type)
        return fn(x, *params, **static)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,), params = ctx.saved_tensors, ctx.params
        grad_x = opaque_backward(_recomputed_backward, [x, grad.contiguous(), *params], fn=ctx.fn,
                                static=tuple(ctx.static.items()), autocast=ctx.autocast,
                                needs=tuple(ctx.needs_input_grad[3:]))
        return (grad_x if ctx.needs_input_grad[0] else None), None, None, *(None for _ in params)


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """What a recompute must re-enter to compute as the forward did (as torch.utils.checkpoint does)."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(state: tuple[str, bool, torch.dtype]) -> contextlib.AbstractContextManager:
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _recomputed_backward(x: torch.Tensor, grad: torch.Tensor, *params: torch.Tensor, fn: Callable[..., torch.Tensor],
                         static: tuple, autocast: tuple, needs: tuple[bool, ...]) -> torch.Tensor:
    kwargs = dict(static)
    with torch.enable_grad(), _autocast(autocast):
        leaf = x.detach().requires_grad_()
        (grad_x,) = torch.autograd.grad(fn(leaf, *(p.detach() for p in params), **kwargs), leaf, grad)
    for index, param in enumerate(params):
        if needs[index]:
            compute = _parameter_grad(fn, kwargs, autocast, x, grad, params, index)
            deliver(param, compute)
    return grad_x


def _parameter_grad(fn: Callable[..., torch.Tensor], kwargs: dict[str, Any], autocast: tuple, x: torch.Tensor,
                    grad: torch.Tensor, params: tuple[torch.Tensor, ...],
                    index: int) -> Callable[[], torch.Tensor]:
    """The gradient of parameter `index` of fn(x, *params): fn again from stand-ins (zeros of the parameters'
    shapes), the one asked for a leaf."""

    def compute() -> torch.Tensor:
        with torch.enable_grad(), _autocast(autocast):
            stand_ins = [torch.zeros_like(p) for p in params]
            stand_ins[index].requires_grad_()
            (result,) = torch.autograd.grad(fn(x.detach(), *stand_ins, **kwargs), stand_ins[index], grad)
        return result

    return compute


# ---- torch.compile: one opaque op runs every split backward --------------------------------------------------

_BACKWARDS: dict[str, tuple[Callable[..., torch.Tensor], dict[str, Any]]] = {}


def opaque_backward(impl: Callable[..., torch.Tensor], tensors: list[torch.Tensor], **static: Any) -> torch.Tensor:
    """impl(*tensors, **static), a layer's backward that returns the input gradient (shaped as tensors[0], typed
    as it or as `static`'s input_dtype where that is set) and hands weight gradients to `deliver`. Eagerly it is
    called; while torch.compile traces a backward it becomes one call of the opaque op
    `megalite::opaque_backward`, which calls it when the compiled backward runs, so that `deferred` decides then.
    `static` (groups, flags) is registered under a name the traced graph keeps; the tensors, parameters included,
    are passed at every call."""
    if not torch.compiler.is_compiling():
        return impl(*tensors, **static)
    name = f"{impl.__module__}.{impl.__qualname__}:{sorted(static.items(), key=lambda kv: kv[0])!r}"
    _BACKWARDS.setdefault(name, (impl, static))
    return _opaque_backward_op(name, tensors)


@torch.library.custom_op("megalite::opaque_backward", mutates_args=())
def _opaque_backward_op(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    impl, static = _BACKWARDS[name]
    return impl(*tensors, **static)


@_opaque_backward_op.register_fake
def _(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    dtype = _BACKWARDS[name][1].get("input_dtype") or tensors[0].dtype  # an input kept in FP8 (gemm.py)
    return torch.empty_like(tensors[0], dtype=dtype)
