"""The CUDA kernels' side of the FP8 recipes, tested on the CPU by everything but the CUDA call itself: the padded
per-expert layout torch._scaled_grouped_mm runs on (padding changes no expert's result: the kernel's arithmetic,
emulated here from its documented contract, on the padded layout equals the per-expert emulation bit for bit), the
segmented per-expert quantisation, the 1 x 128 / 128 x 128 scale layouts torch._scaled_mm reads (shapes and strides
as ScaledBlas.cpp checks them, values per tile read back from memory as cuBLAS reads them), and the dispatch
decisions. The CUDA calls are run by tools/gpu_check.py's FP8 step (fp8 kernels against the emulation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megalite.parallel.fp8 import RECIPES, block_kernel, grouped_kernel
from megalite.parallel.fp8.quantize import E4M3
from megalite.parallel.gemm import RowGroups

SIZES = [5, 0, 37, 16]  # uneven, an expert without tokens, one already aligned


def _offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _integers(*shape: int, seed: int) -> torch.Tensor:
    """Small integers, whose FP8 values, products and sums are exact in fp32 in any order (so a different
    summation order, from a differently shaped matmul, cannot hide or fake a difference)."""
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float()


def emulated_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm's contract (GroupedBlas.cpp, ScaledGroupMM.cu) in fp32: [rows, k] x [experts, k,
    n] with scale_a per row and scale_b [experts, n], each expert's rows offs[e-1]:offs[e]; or [m, K] x [K, n]
    with each expert's columns of the contraction and scale_a [experts * m], scale_b [experts * n]."""
    bounds = [0, *offs.tolist()]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2])
        for e, (start, end) in enumerate(zip(bounds, bounds[1:])):
            out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (b[e].float() * scale_b[e])
        return out
    m, n = a.shape[0], b.shape[1]
    out = torch.zeros(len(offs), m, n)
    for e, (start, end) in enumerate(zip(bounds, bounds[1:])):
        out[e] = ((a[:, start:end].float() * scale_a[e * m : (e + 1) * m, None])
                  @ (b[start:end].float() * scale_b[e * n : (e + 1) * n]))
    return out


def test_padded_layout_puts_each_experts_rows_on_16_row_boundaries():
    """Every expert's rows keep their order and start on a multiple of 16; an expert without rows gets one block;
    the layout's length is the planner's bound (rows + 16 per expert), so padding needs no host read."""
    padded = grouped_kernel.pad_groups(_offsets(SIZES), sum(SIZES))
    assert padded.offsets.tolist() == [16, 32, 80, 96]
    assert padded.rows == grouped_kernel.padded_rows_bound(58, 4, 16) == 128
    starts = [0, 16, 32, 80]
    assert padded.positions.tolist() == [*range(0, 5), *range(32, 69), *range(80, 96)]
    assert all(start % 16 == 0 for start in starts)
    assert padded.expert[:96].tolist() == [0] * 16 + [1] * 16 + [2] * 48 + [3] * 16
    x = _integers(58, 32, seed=0)
    rows = grouped_kernel.pad_rows(x, padded)
    assert torch.equal(grouped_kernel.unpad_rows(rows, padded), x)
    assert rows.abs().sum() == x.abs().sum()  # the padding is zeros
    tiles = grouped_kernel.pad_groups(_offsets(SIZES), sum(SIZES), 128)  # blockwise's whole 128-token tiles
    assert tiles.offsets.tolist() == [128, 256, 384, 512] and tiles.rows == 640
    assert torch.equal(grouped_kernel.unpad_rows(grouped_kernel.pad_rows(x, tiles), tiles), x)


def test_padding_never_changes_an_experts_result():
    """Rowwise through the padded layout and the grouped kernel's arithmetic equals the per-expert emulation (each
    expert's dense FP8 matmul) bit for bit: forward, input gradient and weight gradient."""
    recipe = RECIPES["rowwise"]()
    x, w, g = _integers(58, 32, seed=1), _integers(4, 48, 32, seed=2) / 16, _integers(58, 48, seed=3) / 64
    offsets = _offsets(SIZES)
    groups = RowGroups(offsets)
    mm = emulated_grouped_mm
    assert torch.equal(grouped_kernel.grouped_forward(recipe, x, w, offsets, mm), recipe.grouped(x, w, groups))
    assert torch.equal(grouped_kernel.grouped_input_grad(recipe, g, w, offsets, mm),
                       recipe.grouped_input_grad(g, w, groups))
    dw = grouped_kernel.grouped_weight_grad(recipe, g, x, offsets, mm)
    assert torch.equal(dw, recipe.grouped_weight_grad(g, x, groups))
    assert torch.equal(dw[1], torch.zeros(48, 32)) and dw.abs().sum() > 0


def test_segmented_quantisation_is_each_experts_own():
    """Quantising grad^T per feature along each expert's own tokens, all experts at once, gives each expert's
    rowwise FP8 values and scales bit for bit, and hands every expert's amax to the reduction in one tensor."""
    seen = []
    recipe = RECIPES["rowwise"](lambda amax, operand, matmul, whole: seen.append((amax.shape, whole)) or amax)
    g = torch.randn(58, 48, generator=torch.Generator().manual_seed(4))
    padded = grouped_kernel.pad_groups(_offsets(SIZES), 58)
    data, scale = grouped_kernel.quantize_segments(grouped_kernel.pad_rows(g, padded).t(), padded.expert, 4,
                                                   recipe.scalings["grad"], True, recipe.amax, "grad", "weight_grad")
    assert seen == [((4 * 48, 1), (False, True))] and scale.shape == (4, 48)
    start = 0
    for e, size in enumerate(SIZES):
        own = recipe.quantize(g[start : start + size].t(), "grad", "weight_grad")
        columns = padded.positions[start : start + size]
        assert torch.equal(data[:, columns].view(torch.uint8), own.data.view(torch.uint8)), e
        assert torch.equal(scale[e], own.scale.reshape(-1)), e
        start += size


def _read_as_cublas(scale: torch.Tensor, rows: int, cols: int, row_stride: int, col_stride: int) -> torch.Tensor:
    """The [rows, cols] matrix at `scale`'s memory read with the given strides, as the kernel reads it."""
    flat = torch.as_strided(scale, (scale.untyped_storage().nbytes() // 4,), (1,), 0)
    index = torch.arange(rows)[:, None] * row_stride + torch.arange(cols)[None, :] * col_stride
    return flat[index]


@pytest.mark.parametrize("k", [640, 512])
def test_block_scale_layouts_are_the_ones_scaled_mm_reads(k):
    """x [m, k] in 1 x 128 tiles and W [n, k] in 128 x 128 blocks (k / 128 = 5, padded to 8, and 4): scale_a is
    [m, k/128] with stride (1, m); scale_b^T is [n/128, k/128] with stride (round_up(k/128, 4), 1) (ScaledBlas.cpp
    `is_blockwise_1x128_scaling` / `is_blockwise_128x128_scaling`); the W^T-side 1 x 128 scales of a weight
    gradient's b are [k/128, n] row-major. Each holds every tile's own scale at the place cuBLAS reads it."""
    recipe = RECIPES["blockwise"]()
    m, n = 40, 256
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    qx, qw = recipe.quantize(x, "input", "forward"), recipe.quantize(w, "weight", "forward")
    kb, l4 = k // 128, -(-k // 128 // 4) * 4
    a_data, b_data, scale_a, scale_b = block_kernel.kernel_operands(qx, qw)
    assert a_data.shape == (48, k) and b_data.shape == (k, n) and b_data.stride() == (1, k)  # rows padded to 16
    assert scale_a.shape == (48, kb) and scale_a.stride() == (1, 48)
    assert torch.equal(_read_as_cublas(scale_a, m, kb, 1, 48), qx.scale)
    assert torch.equal(scale_a[m:], torch.ones(48 - m, kb))
    assert scale_b.shape == (kb, 2) and scale_b.t().stride() == (l4, 1)
    assert torch.equal(_read_as_cublas(scale_b, 2, kb, l4, 1), qw.scale)  # block (i, j) at i * l4 + j
    tiles = recipe.quantize(torch.randn(256, k).t(), "input", "weight_grad")  # x^T [k, 256 tokens] as b
    tile_b = block_kernel.tile_scales_b(tiles.scale)
    assert tile_b.shape == (2, k) and tile_b.is_contiguous()
    assert torch.equal(_read_as_cublas(tile_b, k, 2, 1, k), tiles.scale)  # scale_b^T [n, k/128], stride (1, n)
    assert torch.equal(block_kernel.tile_scales_a(qx.scale).contiguous(), qx.scale)  # the round trip


def test_blockwise_kernel_operands_multiply_to_the_emulation():
    """The padded data and laid-out scales, multiplied as cuBLAS's block scaling multiplies them (each product
    term scaled by its a-tile's and b-block's scales, read from memory), equal the emulation bit for bit, a
    weight gradient's 37 tokens (padded to 128) included."""
    recipe = RECIPES["blockwise"]()
    for a, a_is, b, b_is, matmul in ((_integers(40, 384, seed=5), "input", _integers(144, 384, seed=6) / 8,
                                      "weight", "forward"),
                                     (_integers(48, 37, seed=7), "grad", _integers(160, 37, seed=8), "input",
                                      "weight_grad")):
        qa, qb = recipe.quantize(a, a_is, matmul), recipe.quantize(b, b_is, matmul)
        a_data, b_data, scale_a, scale_b = block_kernel.kernel_operands(qa, qb)
        m, k = a_data.shape
        n = b_data.shape[1]
        sa = _read_as_cublas(scale_a, m, k // 128, 1, m).repeat_interleave(128, 1)
        if qb.tile == (128, 128):
            blocks = -(-n // 128)
            sb = _read_as_cublas(scale_b, blocks, k // 128, scale_b.stride(1), 1)
            sb = sb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        else:
            sb = _read_as_cublas(scale_b, n, k // 128, 1, n).repeat_interleave(128, 1)
        product = (a_data.float() * sa) @ (b_data.t().float() * sb).t()
        expected = qa.dequantize() @ qb.dequantize().t()
        assert torch.equal(product[: a.shape[0], : b.shape[0]], expected), matmul


def test_kernel_dispatch_decisions(monkeypatch):
    """Which kernel each recipe's operands get: blockwise on CUDA >= 12.9 and SM90 only (else the emulation),
    never on the CPU; the grouped kernel for rowwise on SM90 / SM100 with 16-aligned widths only."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=9, minor=0))
    for version, expected in (("12.9", True), ("13.0", True), ("12.8", False), (None, False)):
        monkeypatch.setattr(torch.version, "cuda", version)
        assert block_kernel.kernel_available(cuda) is expected, version
    assert not block_kernel.kernel_available(torch.device("cpu"))
    rowwise = RECIPES["rowwise"]().scalings
    assert grouped_kernel.kernel_takes(rowwise, cuda, 2048, 1408)
    assert not grouped_kernel.kernel_takes(rowwise, cuda, 2048, 1400)
    assert not grouped_kernel.kernel_takes(rowwise, torch.device("cpu"), 2048, 1408)
    for name in ("tensorwise", "blockwise"):
        assert not grouped_kernel.kernel_takes(RECIPES[name]().scalings, cuda, 2048, 1408), name
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=10, minor=0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    assert not block_kernel.kernel_available(cuda) and grouped_kernel.kernel_takes(rowwise, cuda, 2048, 1408)
    blockwise = RECIPES["blockwise"]()
    qx = blockwise.quantize(torch.randn(4, 256), "input", "forward")
    qw = blockwise.quantize(torch.randn(256, 256), "weight", "forward")
    assert block_kernel.takes(qx, qw) and qx.data.dtype == E4M3


def test_a_contraction_padded_with_zeros_multiplies_the_same():
    """An expert's 37 tokens in a weight gradient padded to 48 (what kernel_mm does on CUDA, whose torch._scaled_mm
    asks k to be a multiple of 16): the CPU's torch._scaled_mm on the padded FP8 bytes equals the emulation of
    the unpadded operands bit for bit, tensorwise and rowwise."""
    for name in ("tensorwise", "rowwise"):
        recipe = RECIPES[name]()
        qa = recipe.quantize(_integers(37, 48, seed=9).t(), "grad", "weight_grad")
        qb = recipe.quantize(_integers(37, 32, seed=10).t(), "input", "weight_grad")
        a, b = block_kernel.zero_padded(qa.data, 1, 16), block_kernel.zero_padded(qb.data, 1, 16)
        assert a.shape == (48, 48) and b.shape == (32, 48) and not a[:, 37:].float().any()
        scales = (qa.scale.reshape(()), qb.scale.reshape(())) if name == "tensorwise" else (qa.scale, qb.scale.t())
        product = torch._scaled_mm(a, b.t(), *scales, out_dtype=torch.float32)
        assert torch.equal(product, qa.dequantize() @ qb.dequantize().t()), name
