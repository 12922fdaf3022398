"""The one matmul home: every linear layer's y = x W^T + b (`linear`) and every grouped expert matmul
(`grouped_linear`) runs here, forward, input gradient and weight gradient, and a recipe decides how the
operands of each are cast and multiplied.

A `Recipe` is the slot for number formats: `HighPrecision` (the default) multiplies in the compute dtype, the
weights cast as autocast would cast them; an FP8 recipe would quantise the operands and multiply them scaled.
The layers that own matmul weights (column/row-parallel linears, the experts, the LM head) each hold a recipe
(`RecipeSlot`) and hand it over with their weights; `apply_recipe` changes it on a built model, as torchtitan's
float8 converter does, so a new number format is a new recipe, not a branch in layers. The gradients'
structure is the same under every recipe: dX = grad W, dW = grad^T x (per expert for grouped matmuls).

The weight gradient is handed to weight_grads.deliver, which computes it at once or, inside a zero-bubble
schedule's B, in its W, and deposits it into the gradient buffer the weight belongs to (its sink). A dense
matmul adds dW straight into the main gradient there: Megatron-LM's gradient-accumulation fusion. No dW
temporary is made, and under bf16 autocast the product of bf16 operands is accumulated in fp32, not rounded to
bf16 first (on CUDA by cuBLAS with an fp32 output; a CPU has no mixed-dtype GEMM, so there the operands are
widened). Without a buffer (a bare model, a test) dW goes into `weight.grad`. A weight read by several matmuls
in one backward (the tied embedding and the LM head) is the buffer's business (grad_buffer.py), not the
matmul's.

Under sequence parallelism a column-parallel layer's input is all-gathered along the sequence; only the
local shard is kept for backward and gathered again there, overlapped with the input gradient's matmul,
and the input gradient's reduce-scatter is launched before the weight gradient's matmul and awaited after
it, so the two overlap: Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication (a deferred weight
gradient keeps the gathered input until its W instead). On CUDA the overlap needs
CUDA_DEVICE_MAX_CONNECTIONS=1 (cuda_env.py), which makes the GPU start kernels and collectives in the order
they were queued. Under torch.compile the backward runs behind one opaque op (weight_grads.opaque_backward), so
the sink and the split work there too.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.parallel.mappings import all_gather_single, gather_rows, in_compute_dtype, start_reduce_scatter_rows
from megalite.parallel.weight_grads import deliver, opaque_backward


class RowGroups:
    """The rows of a grouped matmul, grouped by expert: `offsets` [experts] int32, the cumulative row counts, on
    the device (all the grouped kernel needs), and their `sizes`, read on the host once, when first asked (a loop
    over the experts needs them), for every matmul of one backward."""

    def __init__(self, offsets: torch.Tensor) -> None:
        self.offsets = offsets

    @functools.cached_property
    def sizes(self) -> list[int]:
        return torch.diff(self.offsets, prepend=self.offsets.new_zeros(1)).tolist()

    def expert_of_rows(self, rows: int) -> torch.Tensor:
        """The local expert of each of the `rows` rows, found on the device (no host read); rows past the last
        offset (a dispatcher's padding, which no expert reads) are given the last expert."""
        index = torch.arange(rows, device=self.offsets.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets, index, right=True).clamp_max_(len(self.offsets) - 1)


@dataclass(frozen=True)
class OperandSplits:
    """Where the rest of a layer's matmul operands lies at a layout, as the layer declares it: its weight
    [out, in] split along its output features (`out`) or input features (`in_`) over a grid axis, its tokens (the
    rows of x and grad) over another (context parallelism, or an expert's sequence ranks), each named by its
    axis (None: whole on this rank, or the same on every rank), and the process group of each set of these
    axes (`groups`, keyed by the axes in the order ("tp", "cp", "etp", "sequence")). A recipe whose scales span
    a split operand (FP8's) agrees them over it; `OperandSplits()` is one device's."""

    out: str | None = None
    in_: str | None = None
    tokens: str | None = None
    groups: dict[tuple[str, ...], dist.ProcessGroup | None] = field(default_factory=dict, compare=False, repr=False)

    def axes(self, operand: str, matmul: str) -> tuple[str | None, str | None]:
        """The axes that split the rows and the contraction k of `operand` ("input", "weight", "grad") as
        `matmul` ("forward", "input_grad", "weight_grad") multiplies it, a b^T of [rows, k] operands: x [tokens,
        in] and W [out, in] forward, grad [tokens, out] and W^T [in, out] for the input gradient, grad^T
        [out, tokens] and x^T [in, tokens] for the weight gradient."""
        rows, k = {"input": (self.tokens, self.in_), "weight": (self.out, self.in_),
                   "grad": (self.tokens, self.out)}[operand]
        transposed = matmul == "weight_grad" or (matmul == "input_grad" and operand == "weight")
        return (k, rows) if transposed else (rows, k)


ONE_DEVICE = OperandSplits()


class KeptInput(NamedTuple):
    """A matmul's input kept for its weight gradient in the form that gradient multiplies it, instead of x: an
    FP8 copy `data` [rows, in] (x's rows, flattened) and its decode `scale`, which every row shares (a recipe's
    `linear_keeping` says when it can)."""

    data: torch.Tensor
    scale: torch.Tensor


class Recipe(ABC):
    """How a matmul's operands are cast and multiplied: dense x [n, in] by weight [out, in], or grouped, rows
    offsets[e-1]:offsets[e] of x by weight[e] of weight [experts, out, in] (`RowGroups`). Outputs and input
    gradients are in the compute dtype, x's and grad's; weight gradients as each method says. A compiled
    backward knows a recipe by its repr: its class and settings (its attributes), which must not change."""

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={value!r}" for name, value in sorted(vars(self).items()))
        return f"{type(self).__qualname__}({settings})"

    def at_layout(self, splits: OperandSplits) -> Recipe:
        """This recipe for a layer whose operands lie as `splits` says; one whose numbers do not depend on the
        rest of an operand (HighPrecision) is itself."""
        return self

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b for x [..., in]."""

    def linear_keeping(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[torch.Tensor, KeptInput | None]:
        """`linear`, and what backward keeps of x for the weight gradient when that is not x itself (None: x)."""
        return self.linear(x, weight, bias), None

    def kept_input_bytes(self, rows: int, features: int, width: int) -> int:
        """Bytes backward keeps of a linear's input of `rows` x `features` elements, `width` bytes each (the
        planner's figure, model/costs.py kept_input_bytes): x itself."""
        return rows * features * width

    @abstractmethod
    def linear_input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad W for grad [..., out]."""

    @abstractmethod
    def linear_weight_grad(self, grad: torch.Tensor, x: torch.Tensor | KeptInput,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        """grad^T x for [n, out] grad and [n, in] x (or what `linear_keeping` kept of it): added into `out`
        (a main gradient, or what waits for one) in out's dtype, and returned; without `out`, a new tensor in
        grad's dtype."""

    @abstractmethod
    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        """Each expert's rows of x times its weight^T."""

    @abstractmethod
    def grouped_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        """Each expert's rows of grad times its weight."""

    @abstractmethod
    def grouped_weight_grad(self, grad: torch.Tensor, x: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        """[experts, out, in]: each expert's rows of grad^T times its rows of x, in grad's dtype."""


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


def grouped_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands, x [n, in] and weight [experts, out, in], forward and
    backward. On CUDA it takes bf16 only, with every row a multiple of 16 bytes (8 elements: the hidden size and
    the experts' width), as its checks in torch/_meta_registrations.py (`_meta_grouped_mm_common`, mirroring
    aten/src/ATen/native/cuda/Blas.cpp) say; the group sizes need no alignment. On the CPU every float dtype runs
    (bf16 with the same 16-byte rows)."""
    return _kernel_takes(x, x.shape[-1], weight.shape[-2])


def _kernel_takes(operand: torch.Tensor, in_features: int, out_features: int) -> bool:
    rows_aligned = in_features % 8 == 0 and out_features % 8 == 0
    if operand.is_cuda:
        return operand.dtype == torch.bfloat16 and rows_aligned
    return operand.dtype != torch.bfloat16 or rows_aligned


@torch.compiler.disable
def _eager_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Outside torch.compile: the compiler checks every grouped GEMM against the CUDA kernel's rules (bf16 only)."""
    return torch._grouped_mm(x, weight, offs=offs)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    matmul = torch._grouped_mm if a.dtype == torch.bfloat16 else _eager_grouped_mm
    return matmul(a, b, offs=offsets)


class HighPrecision(Recipe):
    """Operands in the compute dtype (the weights cast as autocast would cast them); dense weight gradients
    accumulated in the main gradient's dtype. Grouped matmuls run torch._grouped_mm where it takes the operands
    (no host read), else a loop over the experts, which reads the row counts once in forward and once in
    backward; both gradients are the grouped kernel's own backward, bit for bit."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def linear_input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grad.matmul(weight.to(grad.dtype))

    def linear_weight_grad(self, grad: torch.Tensor, x: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return grad.t().matmul(x.to(grad.dtype))
        _accumulate(out, grad, x)
        return out

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        cast = weight.to(x.dtype)
        if grouped_kernel_takes(x, cast):
            return _grouped_mm(x, cast.transpose(-2, -1), groups.offsets)
        return torch.cat([F.linear(part, cast[e]) for e, part in enumerate(x.split(groups.sizes))])

    def grouped_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        cast = weight.to(grad.dtype)
        if _kernel_takes(grad, weight.shape[-1], weight.shape[-2]):
            return _grouped_mm(grad, cast, groups.offsets)
        return torch.cat([g.matmul(cast[e]) for e, g in enumerate(grad.split(groups.sizes))])

    def grouped_weight_grad(self, grad: torch.Tensor, x: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        if _kernel_takes(x, x.shape[-1], grad.shape[-1]):
            return _grouped_mm(grad.t(), x, groups.offsets)
        sizes = groups.sizes
        return torch.stack([g.t().matmul(part) for g, part in zip(grad.split(sizes), x.split(sizes))])


HIGH_PRECISION = HighPrecision()


@runtime_checkable
class RecipeSlot(Protocol):
    """A module whose matmuls run with its `recipe` (set by `apply_recipe`); where its operands are split over
    ranks, it says how in `operand_splits` (an `OperandSplits`; without one, whole on every rank)."""

    recipe: Recipe


def apply_recipe(module: nn.Module, recipe: Recipe) -> None:
    """Every matmul of `module` and its submodules that holds a recipe (`RecipeSlot`) runs with `recipe` at the
    slot's layout (`Recipe.at_layout` of its `operand_splits`): applied to a built model (or a part of it: the
    transformer layers, not the head), as model/recompute.py applies activation recompute."""
    for child in module.modules():
        if isinstance(child, RecipeSlot):
            child.recipe = recipe.at_layout(getattr(child, "operand_splits", ONE_DEVICE))


def weight_grad(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor | KeptInput, recipe: Recipe,
                groups: RowGroups | None = None) -> None:
    """dW = grad^T x of [..., out] grad and [..., in] x (or the [n, in] `KeptInput` the recipe kept of it; with
    `groups`: per expert), handed to
    weight_grads.deliver: now or in W, into the weight's buffer (a dense dW added straight into the target the
    buffer chooses) or, without one, into weight.grad in the weight's dtype. Reads the weight's shape and dtype,
    never its values (ZeRO-3 may have freed them by W)."""
    if groups is not None:
        deliver(weight, lambda: recipe.grouped_weight_grad(grad, x, groups).to(weight.dtype))
        return
    grad = grad.reshape(-1, grad.shape[-1])
    x = x if isinstance(x, KeptInput) else x.reshape(-1, x.shape[-1])
    deliver(weight, lambda: recipe.linear_weight_grad(grad, x).to(weight.dtype),
            lambda target: recipe.linear_weight_grad(grad, x, target.view(weight.shape)))


def bias_grad(bias: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: dist.ProcessGroup | None, recipe: Recipe) -> torch.Tensor:
        y, kept = recipe.linear_keeping(x if group is None else gather_rows(x, group), weight, bias)
        ctx.input_dtype = None if kept is None else x.dtype
        ctx.save_for_backward(*([x] if kept is None else [_rows_of_this_rank(kept.data, group).view(x.shape),
                                                           kept.scale]))
        ctx.params = (weight,) if bias is None else (weight, bias)  # on ctx: a checkpoint's recompute would save copies
        ctx.group, ctx.recipe = group, recipe
        # Not a view to autograd, as F.linear's output is not: a caller may write into it (the vocabulary-parallel
        # cross-entropy does, in fp32), which autograd forbids on a view made inside a custom Function.
        return y if y._base is None else torch.ops.aten._unsafe_view(y, y.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        needs = tuple(ctx.needs_input_grad[:3])
        x, *scale = ctx.saved_tensors
        grad_input = opaque_backward(_linear_backward, [x, grad.contiguous(), *scale, *ctx.params], group=ctx.group,
                                     recipe=ctx.recipe, needs=needs, input_dtype=ctx.input_dtype)
        return (grad_input if needs[0] else None), None, None, None, None


def _rows_of_this_rank(rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's share of `rows` gathered along the sequence over `group` (all of them without one), a copy
    that keeps no other rank's rows alive."""
    if group is None:
        return rows
    return rows.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()


def _linear_backward(x: torch.Tensor, grad: torch.Tensor, *tensors: torch.Tensor, group: dist.ProcessGroup | None,
                     recipe: Recipe, needs: tuple[bool, bool, bool], input_dtype: torch.dtype | None) -> torch.Tensor:
    """The input gradient, returned; the weight and bias gradients, handed to weight_grads (at once, or in W).
    `tensors`: the weight and the bias (if any), after the scale of x when the recipe kept x in FP8 (`input_dtype`
    is then x's dtype, and x the FP8 bytes, shaped as x). Under sequence parallelism x is this rank's rows:
    gathered again here (in FP8 where kept so: half of bf16's bytes), overlapped with the input gradient's matmul,
    whose reduce-scatter overlaps the weight gradient's when that runs now."""
    scale, (weight, *bias) = (None, tensors) if input_dtype is None else (tensors[0], tensors[1:])
    bias = bias[0] if bias else None
    gathering = None
    if group is not None:
        whole = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gathering = all_gather_single(_as_bytes(whole), _as_bytes(x.contiguous()), group, async_op=True)
    grad_input = (recipe.linear_input_grad(grad, weight) if needs[0]  # overlaps the gather
                  else torch.empty_like(x, dtype=input_dtype or x.dtype))
    if gathering is not None:
        gathering.wait()
        x = whole
    if scale is not None:
        x = KeptInput(x.reshape(-1, x.shape[-1]), scale)
    scattering = None
    if group is not None and needs[0]:  # launched first, so it overlaps the dW matmul
        grad_input, scattering = start_reduce_scatter_rows(grad_input, group)
    if needs[1]:
        weight_grad(weight, grad, x, recipe)
    if bias is not None and needs[2]:
        deliver(bias, lambda: bias_grad(bias, grad))
    if scattering is not None:
        scattering.wait()
    return grad_input


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 values as their bytes, which every backend's collectives carry (gloo has no FP8 dtypes)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gather_group: dist.ProcessGroup | None = None, recipe: Recipe = HIGH_PRECISION) -> torch.Tensor:
    """x W^T + b in the compute dtype; `gather_group`: all-gather x along its first (sequence) dimension over
    it first (a column-parallel layer under sequence parallelism)."""
    if gather_group is not None and dist.get_world_size(gather_group) == 1:
        gather_group = None
    return _Linear.apply(in_compute_dtype(x), weight, bias, gather_group, recipe)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: Recipe,
                bias: torch.Tensor | None, adds_bias: bool) -> torch.Tensor:
        ctx.save_for_backward(x, offsets)
        ctx.params = (weight,) if bias is None else (weight, bias)  # on ctx: a checkpoint's recompute would save copies
        ctx.recipe, ctx.adds_bias = recipe, adds_bias
        groups = RowGroups(offsets)
        y = recipe.grouped(x, weight, groups)
        return y if bias is None or not adds_bias else y + bias.to(y.dtype)[groups.expert_of_rows(len(x))]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        x, offsets = ctx.saved_tensors
        weight, *bias = ctx.params
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4])
        grad_x = opaque_backward(_grouped_backward, [x, grad.contiguous(), weight, offsets, *bias], recipe=ctx.recipe,
                                 adds_bias=ctx.adds_bias, needs=needs)
        return (grad_x if needs[0] else None), None, None, None, None, None


def _grouped_backward(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                      bias: torch.Tensor | None = None, *, recipe: Recipe, adds_bias: bool,
                      needs: tuple[bool, bool, bool]) -> torch.Tensor:
    """dX, returned; dW (its rows grad_e^T x_e) and the bias's (each expert's rows of grad summed; zeros where
    this rank did not add the bias), handed to weight_grads."""
    groups = RowGroups(offsets)
    grad_x = recipe.grouped_input_grad(grad, weight, groups) if needs[0] else torch.empty_like(x)
    if needs[1]:
        weight_grad(weight, grad, x, recipe, groups)
    if bias is not None and needs[2]:
        deliver(bias, lambda: _expert_bias_grad(bias, grad, groups, adds_bias))
    return grad_x


def _expert_bias_grad(bias: torch.Tensor, grad: torch.Tensor, groups: RowGroups, added: bool) -> torch.Tensor:
    summed = torch.zeros(bias.shape, dtype=torch.float32, device=grad.device)
    if added:
        summed.index_add_(0, groups.expert_of_rows(len(grad)), grad.float())
    return summed.to(bias.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: Recipe = HIGH_PRECISION,
                   bias: torch.Tensor | None = None, adds_bias: bool = True) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x [tokens, in] times weight[e] [out, in]^T, for every expert e, in x's
    dtype, plus bias[e] [experts, out] when given and `adds_bias` (otherwise the bias's gradient here is zero:
    a bias added to partial sums is added by one rank only); `offsets` [experts] int32 are the cumulative token
    counts, on the device."""
    return _GroupedLinear.apply(x, weight, offsets, recipe, bias, adds_bias)
