"""DeepSeek-V3's 1 x 128 / 128 x 128 scales in the memory layouts torch._scaled_mm reads them in on CUDA.

torch 2.11's _scaled_mm (aten/src/ATen/native/cuda/ScaledBlas.cpp) recognises blockwise scaling from the scales'
shapes and strides (`is_blockwise_1x128_scaling`, `is_blockwise_128x128_scaling`, checked on a and on b^T) and
hands it to cuBLASLt (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / BLK128x128_32F, cuBLAS >= 12.9, SM90 only, no
fast accumulation). For a [m, k] times b [k, n] (our b^T of a [n, k] operand):
- 1 x 128 tiles of a: scale_a [m, k/128] outer-dim-major, stride (1, m): all rows' scales of one k-block together.
- 1 x 128 tiles of b^T [n, k]: scale_b^T [n, k/128] stride (1, n), so scale_b is [k/128, n] row-major.
- 128 x 128 blocks of b^T: scale_b^T [n/128, k/128] row-major with rows padded to a multiple of four blocks
  (stride (round_up(k/128, 4), 1)), so scale_b is [k/128, n/128] with stride (1, round_up(k/128, 4)).
(k/128 and n/128 round up.) Copies of ScaledBlas.cpp differ on the four-block padding of the 128 x 128 layout
(the v2.11 tag could not be read here; recipes.py's earlier reading of 2.11 says padded, which this follows);
where k/128 is a multiple of four, as at Llama-3.1-8B's widths, the two are the same memory, and
tools/gpu_check.py's fp8 step multiplies k = 256 (two blocks, padded to four) against the emulation. The kernel
asks k and n to be multiples of 16 (and the tiles whole along k), so `blockwise_mm` pads the data with zeros to
whole 128-tiles along k (an expert's token count in a weight gradient) and a multiple of 16 rows, which changes no
product. Rows the padding adds to a get a scale of one; they multiply zeros.

Layouts are pure functions of the scales (tested on the CPU, which has no such kernel: tests/test_fp8_kernels.py
reads them back from memory as cuBLAS would); the CUDA call runs where `kernel_available` says so, else
recipes.py runs the emulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.parallel.fp8.quantize import Quantized

BLOCK = 128  # DeepSeek-V3's tile width and weight block
TILE, WEIGHT_BLOCK = (1, BLOCK), (BLOCK, BLOCK)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def zero_padded(data: torch.Tensor, row_multiple: int, col_multiple: int) -> torch.Tensor:
    """FP8 data [rows, k] padded with zeros to multiples of `row_multiple` rows and `col_multiple` columns (through
    its bytes: a zero byte is FP8's +0), contiguous."""
    rows, cols = _round_up(data.shape[0], row_multiple) - data.shape[0], _round_up(data.shape[1], col_multiple)
    return F.pad(data.view(torch.uint8), (0, cols - data.shape[1], 0, rows)).view(data.dtype)


def tile_scales_a(scale: torch.Tensor) -> torch.Tensor:
    """1 x 128 scales [m, k/128] of a as scale_a: the same values, outer-dim-major (stride (1, m))."""
    return scale.t().contiguous().t()


def tile_scales_b(scale: torch.Tensor) -> torch.Tensor:
    """1 x 128 scales [n, k/128] of an [n, k] operand multiplied as b^T, as scale_b [k/128, n] (row-major)."""
    return scale.t().contiguous()


def block_scales_b(scale: torch.Tensor) -> torch.Tensor:
    """128 x 128 scales [n/128, k/128] of an [n, k] operand multiplied as b^T, as scale_b [k/128, n/128] with
    stride (1, round_up(k/128, 4)): each block row's scales padded to four blocks (the padding is never read)."""
    blocks_n, blocks_k = scale.shape
    padded = scale.new_ones(blocks_n, _round_up(blocks_k, 4))
    padded[:, :blocks_k] = scale
    return padded[:, :blocks_k].t()


def kernel_operands(a: Quantized, b: Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a data, b^T data, scale_a, scale_b) for torch._scaled_mm of a [m, k] (1 x 128 tiles) by b^T, b [n, k]
    (1 x 128 tiles or 128 x 128 blocks): data padded with zeros to whole 128-tiles along k and rows to a multiple
    of 16, the scales in the kernel's layouts (a's padded rows scaled by one)."""
    m, n = a.data.shape[0], b.data.shape[0]
    rows_a, rows_b = _round_up(m, 16) - m, _round_up(n, 16) - n
    a_data, b_data = zero_padded(a.data, 16, BLOCK), zero_padded(b.data, 16, BLOCK)
    scale_a = tile_scales_a(F.pad(a.scale, (0, 0, 0, rows_a), value=1.0))
    if b.tile == WEIGHT_BLOCK:
        scale_b = block_scales_b(b.scale)
    else:
        scale_b = tile_scales_b(F.pad(b.scale, (0, 0, 0, rows_b), value=1.0))
    return a_data, b_data.t(), scale_a, scale_b


def takes(a: Quantized, b: Quantized) -> bool:
    """Whether these operands are blockwise as the kernel pairs them: a in 1 x 128 tiles, b in 1 x 128 tiles or
    128 x 128 blocks, both e4m3."""
    e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn
    return e4m3 and a.tile == TILE and b.tile in (TILE, WEIGHT_BLOCK)


def kernel_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm multiplies blockwise scales on `device`: CUDA built with 12.9 or later (cuBLASLt's
    block scaling) on an SM90 GPU (the only architecture cuBLAS's 1 x 128 / 128 x 128 modes run on)."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    major, minor = (int(part) for part in torch.version.cuda.split(".")[:2])
    gpu = torch.cuda.get_device_properties(device)  # a constant to torch.compile
    return (major, minor) >= (12, 9) and (gpu.major, gpu.minor) == (9, 0)


def blockwise_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """a b^T [m, n] through torch._scaled_mm's blockwise scaling, bf16 (as the rowwise kernel's)."""
    a_data, b_data, scale_a, scale_b = kernel_operands(a, b)
    out = torch._scaled_mm(a_data, b_data, scale_a, scale_b, out_dtype=torch.bfloat16)
    return out[: a.data.shape[0], : b.data.shape[0]]
