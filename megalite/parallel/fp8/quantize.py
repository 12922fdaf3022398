"""FP8 quantisation: a matmul operand cut into tiles along its contraction dimension, one scale per tile from the
tile's current amax, the values scaled into an FP8 format and back.

Every operand is seen as [rows, k], k the dimension its matmul contracts over (a linear's input features in the
forward, its output features in the input gradient, the tokens in the weight gradient), and a `Scaling` names the
format and the tile: (rows, k) tiles give one scale per tensor (tensorwise), (1, k) one per row (rowwise), (1, 128)
and (128, 128) DeepSeek-V3's tiles and blocks. A tile that does not fill (a last partial tile, an expert's token
count) is padded with zeros, which change no amax and add nothing to a product: what a kernel's alignment padding
does.

The scale: `scale = fp8_max / amax` multiplies into the format so that the tile's largest magnitude lands on the
format's largest value (no margin: the amax is the current one, so nothing saturates). With `power_of_two`
the scale is rounded down to a power of two (2^floor(log2(fp8_max / amax))): the largest magnitude then lands
in (fp8_max / 2, fp8_max], so at most one binade of range is given up, and in exchange multiplying by the scale
and by its inverse is exact, so the only rounding is the FP8 cast itself, the dequantised values are the same
whichever kernel applies the scale, and a scale agreed between ranks is bit for bit the one-device scale.
Kernels take the inverse (the decode scale): `Quantized.scale` holds that, per tile.

Which ranks share a scale is the `AmaxReduction`'s business: a tile's amax is handed to it before the scale is
made, naming the operand and the matmul, so that a layout whose ranks each hold part of a tile (a tensor-parallel
shard of a tensorwise tensor, a row split along its contraction dimension by a row-parallel layer, a sequence
shard along the tokens of a weight gradient) can reduce the amax over exactly those ranks and get the one-device
scale. On one device nothing is shared: `LOCAL_AMAX` returns the amax as it is; parallel/fp8/sharded.py reduces
it over the ranks a layout spreads an operand over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn  # 3 mantissa bits, max 448: inputs and weights
E5M2 = torch.float8_e5m2  # 2 mantissa bits, max 57344: output gradients, whose range is wider
AMAX_FLOOR = 1e-12  # an all-zero tile still gets a finite scale (its values quantise to zeros anyway)
GATHERED = "gathered_fp8"  # where a weight gathered in FP8 keeps its Quantized copy (param_gather.py)

Operand = Literal["input", "weight", "grad"]
Matmul = Literal["forward", "input_grad", "weight_grad"]


class AmaxReduction(Protocol):
    """Agrees the amax of tiles that several ranks hold parts of: returns `amax` [tile rows, tile columns]
    (fp32, this rank's amax of each tile) reduced by max over the ranks that share `operand`'s tiles in `matmul`.
    `whole`: whether a tile spans all of this rank's rows and all of its k (a tensorwise tile both, a rowwise
    tile k; a tile of fixed size neither, and then it lies on this rank: the validator makes every rank's share
    whole tiles). Called on every rank that holds a part, in the same order (a collective, where there is one)."""

    def __call__(self, amax: torch.Tensor, operand: Operand, matmul: Matmul,
                 whole: tuple[bool, bool]) -> torch.Tensor: ...


class LocalAmax:
    """One device, or a layout whose tiles each lie on one rank: every amax is already the whole tile's."""

    def __call__(self, amax: torch.Tensor, operand: Operand, matmul: Matmul,
                 whole: tuple[bool, bool]) -> torch.Tensor:
        return amax

    def __repr__(self) -> str:
        return "LocalAmax()"


LOCAL_AMAX = LocalAmax()


@dataclass(frozen=True)
class Scaling:
    """An operand's format and tile: `rows` x `cols` elements of its [rows, k] view share a scale; None spans the
    whole dimension."""

    dtype: torch.dtype
    rows: int | None
    cols: int | None

    def tile(self, shape: tuple[int, int]) -> tuple[int, int]:
        return max(1, self.rows or shape[0]), max(1, self.cols or shape[1])

    @property
    def per_tensor(self) -> bool:
        return self.rows is None and self.cols is None

    @property
    def per_row(self) -> bool:
        return self.rows == 1 and self.cols is None


@dataclass
class Quantized:
    """An operand in FP8: `data` [rows, k] and the decode `scale` of each tile [ceil(rows / tile rows),
    ceil(k / tile cols)], fp32 (data * scale is the value it stands for)."""

    data: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the FP8 data stands for: each element times its tile's scale."""
        blocks = tiled(self.data.float(), self.tile) * self.scale[:, None, :, None]
        return untiled(blocks, self.data.shape)

    def rows(self, first: int, count: int) -> Quantized:
        """Rows [first, first + count) of the operand, whose tiles they hold whole (an expert's weight in the
        stacked [experts * out, in] copy of a grouped weight)."""
        tiles = slice(first // self.tile[0], -(-(first + count) // self.tile[0]))
        return Quantized(self.data[first:first + count], self.scale[tiles], self.tile)

    def t(self) -> Quantized:
        """The transposed operand [k, rows], its tiles transposed: what quantising the transposed values gives
        wherever a tile's amax is the same both ways (a tensor's, a 128 x 128 block's), so a weight quantised
        once serves its forward and its input gradient."""
        return Quantized(self.data.t().contiguous(), self.scale.t().contiguous(), (self.tile[1], self.tile[0]))


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    """The multiplier that maps a tile of largest magnitude `amax` onto `dtype`'s range (see the module's
    docstring for the rounding), fp32."""
    amax = amax.float().clamp(min=AMAX_FLOOR)
    scale = amax.new_tensor(torch.finfo(dtype).max) / amax  # a true division (number / tensor multiplies by 1 / amax)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def quantize(t: torch.Tensor, scaling: Scaling, power_of_two: bool, amax: AmaxReduction, operand: Operand,
             matmul: Matmul) -> Quantized:
    """t [rows, k] in FP8 (contiguous) with one scale per tile, the tiles' amax agreed by `amax`."""
    tile = scaling.tile(tuple(t.shape))
    blocks = tiled(t.float(), tile)
    whole = (scaling.rows is None, scaling.cols is None)
    scale = amax_to_scale(amax(blocks.abs().amax(dim=(1, 3)), operand, matmul, whole), scaling.dtype, power_of_two)
    return Quantized(untiled(encode(blocks, scale, scaling.dtype), t.shape).contiguous(), scale.reciprocal(), tile)


def encode(blocks: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `blocks` (`tiled`'s) times each tile's `scale` [tile rows, tile columns], in `dtype`."""
    limit = torch.finfo(dtype).max
    return (blocks * scale[:, None, :, None]).clamp(-limit, limit).to(dtype)


def tiled(t: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """t [rows, k] as [tile rows, rows per tile, tile columns, columns per tile], partial tiles padded with
    zeros; an empty dimension is one tile of zeros, so that a rank holding none of an operand (an expert no
    token of its chunk chose) still agrees that tile's amax with the ranks holding the rest."""
    rows, cols = tile
    padded = F.pad(t, (0, _padding(t.shape[1], cols), 0, _padding(t.shape[0], rows)))
    return padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def _padding(size: int, tile: int) -> int:
    return -size % tile if size else tile


def untiled(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    tiles, rows, tile_cols, cols = blocks.shape
    return blocks.reshape(tiles * rows, tile_cols * cols)[: shape[0], : shape[1]]
