"""FP8 recipes for the one matmul home (parallel/gemm.py): each of a linear's three matmuls, forward, input
gradient and weight gradient, multiplies two operands quantised as the recipe says.

Every matmul is a b^T with both operands [rows, k] along the contraction k: the forward x [tokens, in] by
W [out, in], the input gradient grad [tokens, out] by W^T [in, out], the weight gradient grad^T [out, tokens] by
x^T [in, tokens]. A recipe gives each operand a `Scaling` (format and tile, quantize.py):

| recipe       | input (x)          | weight              | output gradient     | powers of two |
|--------------|--------------------|---------------------|---------------------|---------------|
| `tensorwise` | e4m3, per tensor   | e4m3, per tensor    | e5m2, per tensor    | no (torchao)  |
| `rowwise`    | e4m3, per row      | e4m3, per row       | e4m3, per row       | yes (torchao) |
| `blockwise`  | e4m3, 1 x 128      | e4m3, 128 x 128     | e4m3, 1 x 128       | yes           |

"Per row" is along the contraction, so the weight is scaled per output feature in the forward and per input
feature in the input gradient, and in the weight gradient x and grad are scaled per feature along the tokens
(DeepSeek-V3's blockwise likewise re-tiles x 128 x 1 along the tokens there: section 3.3 of its report). The
weight's 128 x 128 blocks are the same blocks for W and W^T. Powers of two: torchao rounds the rowwise scales,
not the tensorwise ones; blockwise rounds them as Transformer Engine's block scaling and DeepSeek-V3.1's UE8M0
scales do (quantize.py says what that costs and buys).

Grouped (expert) matmuls are each expert's dense matmul: every operand quantised per expert (an expert's
weight, its rows of x and of grad), so an expert's product is the one its rows would get from a dense layer.
Products are exact fp32 sums of the dequantised operands; outputs and input gradients are cast to the compute
dtype, weight gradients are added into the fp32 main gradient (weight_grads.deliver's contract, as
HighPrecision's).

What backward keeps of a linear's input x for the weight gradient: under `tensorwise` x's forward FP8 copy and
its scale (1 byte an element instead of bf16's 2 or fp32's 4), as Transformer Engine keeps its FP8 inputs: x^T's
one scale is x's (the same amax over the same elements and ranks), so the copy is the one the weight gradient
would make, byte for byte, and is not made twice; under sequence parallelism each rank keeps its rows of it and
gathers the FP8 bytes again in backward (half of bf16's traffic). `rowwise` and `blockwise` keep x in the
compute dtype, as torchao keeps it: their weight gradient scales x^T along the tokens (one scale per feature, or
per 128 tokens of a feature), not along the features as the forward does, so the forward copy cannot serve. A
second, token-tiled quantisation made in forward (Transformer Engine's column-wise copy for block scaling) would
keep 1 + 4/128 bytes an element under `blockwise` (1 under `rowwise`) instead of 2, moving that quantisation
and, under sequence parallelism, its scales' gather into the forward; not built yet. Grouped (expert) matmuls
keep their x in the compute dtype under every recipe.

Kernels: on CUDA tensorwise and rowwise operands go through torch._scaled_mm. Its CPU kernel takes them too and
equals the emulation bit for bit (tests/test_fp8.py), but runs several times slower than the emulation's fp32
matmul (about 3 GFLOP/s on one core), so a CPU runs the emulation. On CUDA rowwise returns bf16 (CUTLASS's
rowwise kernel takes no fp32 output before cuBLAS 12.9), so there its products, the weight gradient included,
are rounded to bf16 as torchao's are. Blockwise goes through torch._scaled_mm's 1 x 128 / 128 x 128 scaling where
torch 2.11 has it (SM90, CUDA >= 12.9; the scales in the layouts block_kernel.py makes, bf16 out), else the
emulation (quantise, dequantise, fp32 matmul). Rowwise grouped matmuls on CUDA (SM90 / SM100) run as one
torch._scaled_grouped_mm call each, every expert's rows padded to 16 (grouped_kernel.py); tensorwise (e5m2
gradients, which that kernel does not take) and blockwise (no grouped kernel in torch 2.11) loop over the experts,
each a dense matmul as above, an expert's tokens padded with zeros to 16 (tensorwise, rowwise) or 128 (blockwise)
where they are the contraction.
"""

from __future__ import annotations

import torch

from megalite.parallel.fp8 import block_kernel, grouped_kernel
from megalite.parallel.fp8.block_kernel import BLOCK
from megalite.parallel.fp8.quantize import (
    E4M3,
    E5M2,
    GATHERED,
    LOCAL_AMAX,
    AmaxReduction,
    Matmul,
    Operand,
    Quantized,
    Scaling,
    quantize,
)
from megalite.parallel.fp8.sharded import ShardedAmax
from megalite.parallel.gemm import KeptInput, OperandSplits, Recipe, RowGroups


class Float8(Recipe):
    """A recipe of FP8 matmuls: each operand quantised with its `scalings` entry ("input", "weight", "grad"),
    scales rounded to powers of two when `power_of_two`, tiles' amax agreed by `amax` (quantize.AmaxReduction:
    the seam where a layout's ranks that share a tile reduce its amax)."""

    def __init__(self, name: str, scalings: dict[Operand, Scaling], power_of_two: bool,
                 amax: AmaxReduction = LOCAL_AMAX) -> None:
        self.name, self.scalings, self.power_of_two, self.amax = name, scalings, power_of_two, amax

    def at_layout(self, splits: OperandSplits) -> Float8:
        """This recipe with its amax agreed over the ranks that `splits` spreads the layer's operands over."""
        if not (splits.out or splits.in_ or splits.tokens):
            return self
        return Float8(self.name, self.scalings, self.power_of_two, ShardedAmax(splits))

    def quantize(self, t: torch.Tensor, operand: Operand, matmul: Matmul) -> Quantized:
        return quantize(t, self.scalings[operand], self.power_of_two, self.amax, operand, matmul)

    def product(self, a: torch.Tensor, a_is: Operand, b: torch.Tensor, b_is: Operand, matmul: Matmul) -> torch.Tensor:
        """a b^T of a [m, k] and b [n, k], each quantised as what it is, fp32 (bf16 from CUDA's rowwise kernel)."""
        return scaled_mm(self.quantize(a, a_is, matmul), self.quantize(b, b_is, matmul))

    @property
    def keeps_fp8_input(self) -> bool:
        """Whether backward keeps x's forward FP8 copy for the weight gradient instead of x (the module's
        docstring says when)."""
        return self.scalings["input"].per_tensor

    def weight(self, weight: torch.Tensor, matmul: Matmul, expert: int | None = None) -> Quantized:
        """The weight operand (of a grouped weight, expert `expert`'s) of the forward (W) or the input gradient
        (W^T): the copy gathered in FP8 where the weight has one (train.fp8_param_gather: quantised from the same
        values with the same scales, so the same operand), else the weight quantised now."""
        gathered = getattr(weight, GATHERED, None)
        if gathered is not None:
            if expert is not None:
                gathered = gathered.rows(expert * weight.shape[1], weight.shape[1])
            return gathered if matmul == "forward" else gathered.t()
        weight = weight if expert is None else weight[expert]
        return self.quantize(weight if matmul == "forward" else weight.t(), "weight", matmul)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               expert: int | None = None) -> torch.Tensor:
        """x W^T + b; `expert`: W is that expert's of a grouped weight."""
        return self.linear_keeping(x, weight, bias, expert)[0]

    def linear_keeping(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       expert: int | None = None) -> tuple[torch.Tensor, KeptInput | None]:
        qx = self.quantize(x.reshape(-1, x.shape[-1]), "input", "forward")
        y = scaled_mm(qx, self.weight(weight, "forward", expert))
        if bias is not None:
            y = y + bias.to(y.dtype)
        kept = KeptInput(qx.data, qx.scale) if self.keeps_fp8_input else None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[-2]), kept

    def kept_input_bytes(self, rows: int, features: int, width: int) -> int:
        if self.keeps_fp8_input:
            return rows * features + 4  # e4m3 bytes and one fp32 scale
        return super().kept_input_bytes(rows, features, width)

    def linear_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        grad_2d = grad.reshape(-1, grad.shape[-1])
        dx = scaled_mm(self.quantize(grad_2d, "grad", "input_grad"), self.weight(weight, "input_grad", expert))
        return dx.to(grad.dtype).reshape(*grad.shape[:-1], weight.shape[-1])

    def linear_weight_grad(self, grad: torch.Tensor, x: torch.Tensor | KeptInput,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, KeptInput):  # x^T's quantisation is x's, transposed: same amax, scale and bytes
            quantized_grad = self.quantize(grad.t(), "grad", "weight_grad")
            data = x.data.t().contiguous()
            dw = scaled_mm(quantized_grad, Quantized(data, x.scale, self.scalings["input"].tile(tuple(data.shape))))
        else:
            dw = self.product(grad.t(), "grad", x.t(), "input", "weight_grad")
        if out is None:
            return dw.to(grad.dtype)
        return out.add_(dw)

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        if grouped_kernel.kernel_takes(self.scalings, x.device, weight.shape[-1], weight.shape[-2]):
            return grouped_kernel.grouped_forward(self, x, weight, groups.offsets).to(x.dtype)
        parts = x.split(groups.sizes)
        return torch.cat([self.linear(part, weight, None, e) for e, part in enumerate(parts)])

    def grouped_input_grad(self, grad: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        if grouped_kernel.kernel_takes(self.scalings, grad.device, weight.shape[-1], weight.shape[-2]):
            return grouped_kernel.grouped_input_grad(self, grad, weight, groups.offsets).to(grad.dtype)
        parts = grad.split(groups.sizes)
        return torch.cat([self.linear_input_grad(part, weight, e) for e, part in enumerate(parts)])

    def grouped_weight_grad(self, grad: torch.Tensor, x: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        if grouped_kernel.kernel_takes(self.scalings, x.device, x.shape[-1], grad.shape[-1]):
            return grouped_kernel.grouped_weight_grad(self, grad, x, groups.offsets).to(grad.dtype)
        sizes = groups.sizes
        return torch.stack([self.linear_weight_grad(g, part) for g, part in zip(grad.split(sizes), x.split(sizes))])


def scaled_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """a b^T of two quantised [m, k] and [n, k] operands: on CUDA torch._scaled_mm where it takes their scales,
    else the exact emulation (both dequantised, multiplied in fp32)."""
    kernel = kernel_for(a, b)
    if kernel is None or not a.data.is_cuda:
        return a.dequantize() @ b.dequantize().t()
    return block_kernel.blockwise_mm(a, b) if kernel == "block" else kernel_mm(a, b, kernel)


def kernel_mm(a: Quantized, b: Quantized, kernel: str) -> torch.Tensor:
    """a b^T through torch._scaled_mm with `kernel`'s scaling ("tensor" or "row", kernel_for's), fp32 (bf16
    from CUDA's rowwise kernel). On CUDA a contraction that is not a multiple of 16 (an expert's tokens in a
    weight gradient) is padded with zeros to one, which the kernel asks for and no sum notices."""
    a_data, b_data = a.data, b.data
    if a_data.is_cuda and a_data.shape[1] % 16:
        a_data, b_data = block_kernel.zero_padded(a_data, 1, 16), block_kernel.zero_padded(b_data, 1, 16)
    if kernel == "tensor":
        return torch._scaled_mm(a_data, b_data.t(), a.scale.reshape(()), b.scale.reshape(()), out_dtype=torch.float32)
    if kernel == "row":
        out = torch.bfloat16 if a_data.is_cuda else torch.float32
        return torch._scaled_mm(a_data, b_data.t(), a.scale, b.scale.t(), out_dtype=out)
    raise ValueError(f"torch._scaled_mm has no {kernel!r} scaling here; kernel_for names the one it takes")


def kernel_for(a: Quantized, b: Quantized) -> str | None:
    """Which scaling of torch._scaled_mm multiplies these operands: "tensor" (both per tensor), "row" (both per
    row, a tile spanning the whole contraction), "block" (1 x 128 tiles by 1 x 128 tiles or 128 x 128 blocks,
    on a device whose torch._scaled_mm has them: block_kernel.kernel_available; block_kernel.py pads the data), or
    None; for the others n must be a multiple of 16 on CUDA, as torch._scaled_mm's checks ask
    (torch/_meta_registrations.py), and kernel_mm pads k to one."""
    (m, k), n = a.data.shape, b.data.shape[0]
    if min(m, n, k) == 0:
        return None
    aligned = not a.data.is_cuda or n % 16 == 0  # kernel_mm pads k
    if aligned and a.tile == (m, k) and b.tile == (n, k):
        return "tensor"
    if aligned and a.tile == (1, k) and b.tile == (1, k):
        return "row"
    if block_kernel.takes(a, b) and block_kernel.kernel_available(a.data.device):
        return "block"
    return None


def tensorwise(amax: AmaxReduction = LOCAL_AMAX) -> Float8:
    whole = Scaling(E4M3, None, None)
    return Float8("tensorwise", {"input": whole, "weight": whole, "grad": Scaling(E5M2, None, None)}, False, amax)


def rowwise(amax: AmaxReduction = LOCAL_AMAX) -> Float8:
    row = Scaling(E4M3, 1, None)
    return Float8("rowwise", {"input": row, "weight": row, "grad": row}, True, amax)


def blockwise(amax: AmaxReduction = LOCAL_AMAX) -> Float8:
    tile = Scaling(E4M3, 1, BLOCK)
    return Float8("blockwise", {"input": tile, "weight": Scaling(E4M3, BLOCK, BLOCK), "grad": tile}, True, amax)


RECIPES = {"tensorwise": tensorwise, "rowwise": rowwise, "blockwise": blockwise}
