"""Grouped (expert) FP8 matmuls in one kernel call: torch._scaled_grouped_mm, rowwise, on CUDA (SM90 / SM100).

The kernel (aten/src/ATen/native/cuda/GroupedBlas.cpp `_scaled_grouped_mm_cuda`, and torch 2.13's checks of it in
torch/_meta_registrations.py `_meta_grouped_mm_common`; the v2.11 tag itself could not be read here, and its
rowwise path has had this signature since 2.8, while 2.13 adds `_scaled_grouped_mm_v2` with explicit recipes)
takes e4m3 operands, fp32 rowwise scales and int32 cumulative `offs`, returns bf16 only, and asks every matrix
dimension it reads whole to be a multiple of 16: a [rows, k] x [experts, k, n] product per expert's rows (forward
and input gradient: scale_a one per row, scale_b [experts, n]) and a [m, tokens] x [tokens, n] product per expert's
tokens (weight gradient: the contraction split by `offs`, scale_a [experts * m] and scale_b [experts * n], one
expert's scales after another). Each expert's rows are padded with zeros to a multiple of `ALIGN` first, so that
every group the kernel reads starts on a 16-row boundary (torchao and torchtitan pad their token groups to 16 for
this kernel), and an expert without tokens gets one block of zeros, so no group is empty; the padded layout has a
fixed bound, rows + experts * ALIGN (rounded up to ALIGN), so padding needs no host read of the counts. Zero rows
change no amax (a zero row's own scale multiplies zeros) and add nothing to any sum: padding changes no expert's
result (tests/test_fp8_kernels.py holds the padded layout to the per-expert emulation bit for bit).

Rowwise quantises x and grad per row and each expert's weight per row, which is the same whether done per expert
or for all experts at once; the weight gradient scales grad^T and x^T per feature along each expert's own tokens
(`quantize_segments`: one amax per feature and expert, reduced by the recipe's AmaxReduction as one tensor).
Tensorwise (e5m2 gradients, which the kernel does not take) and blockwise (no grouped kernel in torch 2.11) loop
over the experts, each a dense matmul (recipes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.parallel.fp8.quantize import E4M3, AmaxReduction, Matmul, Operand, Scaling, amax_to_scale

ALIGN = 16  # rows of each expert group torch._scaled_grouped_mm reads (a multiple of 16, as its K and N must be)


@dataclass
class PaddedGroups:
    """Where each of a grouped matmul's rows lands when every expert's rows are padded to `align`: `positions`
    [rows] int64, `offsets` [experts] int32 (cumulative padded counts) and `expert` [padded rows] (the expert each
    padded row belongs to; rows past the last offset, read by no expert, are given the last), all on the device;
    `rows` the padded layout's fixed length."""

    positions: torch.Tensor
    offsets: torch.Tensor
    expert: torch.Tensor
    rows: int


def padded_rows_bound(rows: int, experts: int, align: int) -> int:
    """The padded layout's length for `rows` rows over `experts` experts: at most `align` extra rows per expert
    (an expert's last partial block, or one block for an expert without rows), rounded up to `align`."""
    return -(-(rows + experts * align) // align) * align


def pad_groups(offsets: torch.Tensor, rows: int, align: int = ALIGN) -> PaddedGroups:
    """The padded layout of `rows` rows grouped by `offsets` (cumulative counts, int32, on the device), each
    expert's count rounded up to a multiple of `align` (at least `align`); computed on the device, no host read."""
    sizes = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    padded = (sizes.clamp(min=1) + align - 1) // align * align
    padded_offsets = padded.cumsum(0)
    index = torch.arange(rows, device=offsets.device)
    expert = torch.searchsorted(offsets.long(), index, right=True)
    positions = index - (offsets.long() - sizes)[expert] + (padded_offsets - padded)[expert]
    bound = padded_rows_bound(rows, len(offsets), align)
    padded_index = torch.arange(bound, device=offsets.device)
    owner = torch.searchsorted(padded_offsets, padded_index, right=True).clamp_max_(len(offsets) - 1)
    return PaddedGroups(positions, padded_offsets.to(torch.int32), owner, bound)


def pad_rows(t: torch.Tensor, padded: PaddedGroups) -> torch.Tensor:
    """t [rows, k] in the padded layout [padded.rows, k]: its rows at their positions, zeros elsewhere."""
    out = t.new_zeros(padded.rows, t.shape[1])
    return out.index_copy_(0, padded.positions, t)


def unpad_rows(t: torch.Tensor, padded: PaddedGroups) -> torch.Tensor:
    """The rows of a padded-layout output that stand for the original rows, in their order."""
    return t.index_select(0, padded.positions)


def quantize_segments(t: torch.Tensor, segment: torch.Tensor, segments: int, scaling: Scaling, power_of_two: bool,
                      amax: AmaxReduction, operand: Operand, matmul: Matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """t [rows, k] quantised per row within each segment of its columns (`segment` [k]: each column's segment):
    rowwise scaling of each expert's own columns of grad^T or x^T, all experts at once. Returns the FP8 data
    [rows, k] and the decode scales [segments, rows] (one expert's after another, as torch._scaled_grouped_mm
    reads them); each segment's amax goes through `amax` as one [segments * rows, 1] tensor, the tiles a
    per-expert quantisation hands over one expert at a time."""
    magnitude = t.float().abs()
    columns = segment.expand(t.shape[0], -1)
    per_segment = magnitude.new_zeros(t.shape[0], segments).scatter_reduce_(1, columns, magnitude, "amax")
    agreed = amax(per_segment.t().reshape(-1, 1), operand, matmul, (False, True))
    scale = amax_to_scale(agreed, scaling.dtype, power_of_two).reshape(segments, t.shape[0])
    limit = torch.finfo(scaling.dtype).max
    data = (t.float() * scale.t()[:, segment]).clamp(-limit, limit).to(scaling.dtype)
    return data.contiguous(), scale.reciprocal()


def kernel_takes(scalings: dict[Operand, Scaling], device: torch.device, in_features: int,
                 out_features: int) -> bool:
    """Whether torch._scaled_grouped_mm runs a recipe's grouped matmuls of experts [out_features, in_features] on
    `device`: CUDA with compute capability 9.0 or 10.x (the kernel's device check), every operand per row in
    e4m3, both widths multiples of 16."""
    rowwise = all(s.per_row and s.dtype == E4M3 for s in scalings.values())
    if not (device.type == "cuda" and rowwise and in_features % 16 == 0 and out_features % 16 == 0):
        return False
    return torch.cuda.get_device_properties(device).major in (9, 10)  # a constant to torch.compile


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offsets: torch.Tensor) -> torch.Tensor:
    """torch._scaled_grouped_mm (bf16 out): b column-major in its last two dimensions, as the kernel asks."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16)


def grouped_forward(recipe, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                    mm=scaled_grouped_mm) -> torch.Tensor:
    """Each expert's rows of x [rows, in] times its weight [experts, out, in]^T through the grouped kernel `mm`
    (bf16 from torch._scaled_grouped_mm): x padded per expert, quantised per row, the weight per output feature."""
    experts, out, k = weight.shape
    padded = pad_groups(offsets, len(x))
    qx = recipe.quantize(pad_rows(x, padded), "input", "forward")
    qw = recipe.quantize(weight.reshape(experts * out, k), "weight", "forward")
    y = mm(qx.data, qw.data.view(experts, out, k).transpose(-2, -1), qx.scale.reshape(-1),
           qw.scale.reshape(experts, out), padded.offsets)
    return unpad_rows(y, padded)


def grouped_input_grad(recipe, grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                       mm=scaled_grouped_mm) -> torch.Tensor:
    """Each expert's rows of grad [rows, out] times its weight [out, in]: the weight quantised per input feature."""
    experts, out, k = weight.shape
    padded = pad_groups(offsets, len(grad))
    qg = recipe.quantize(pad_rows(grad, padded), "grad", "input_grad")
    qw = recipe.quantize(weight.transpose(-2, -1).reshape(experts * k, out), "weight", "input_grad")
    dx = mm(qg.data, qw.data.view(experts, k, out).transpose(-2, -1), qg.scale.reshape(-1),
            qw.scale.reshape(experts, k), padded.offsets)
    return unpad_rows(dx, padded)


def grouped_weight_grad(recipe, grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                        mm=scaled_grouped_mm) -> torch.Tensor:
    """[experts, out, in]: each expert's grad^T times its x, contracted over its (padded) tokens, grad^T and x^T
    scaled per feature along each expert's own tokens."""
    experts = len(offsets)
    padded = pad_groups(offsets, len(x))

    def quantized(t: torch.Tensor, operand: Operand) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_segments(pad_rows(t, padded).t(), padded.expert, experts, recipe.scalings[operand],
                                 recipe.power_of_two, recipe.amax, operand, "weight_grad")

    (g_data, g_scale), (x_data, x_scale) = quantized(grad, "grad"), quantized(x, "input")
    return mm(g_data, x_data.t(), g_scale.reshape(-1), x_scale.reshape(-1), padded.offsets)
