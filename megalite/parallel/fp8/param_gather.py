"""FP8 parameter gathers (train.fp8_param_gather, Megatron-LM's --fp8-param-gather): under the distributed
optimizer and ZeRO-3 the weights of FP8 matmuls are all-gathered as FP8 bytes, half of bf16's traffic (a quarter
of fp32's), and the matmuls use the gathered copy as their weight operand, not quantising the weight again.

Each rank quantises the slice of a bucket it owns (bucket_layout.py: FP8 weights have buckets of their own) from
the values the weight holds, the main weights written back into the parameter's dtype: the values the matmul
would otherwise quantise. The scale of a tile comes from the whole tile's amax, which the ranks owning parts of it
agree on before quantising: every rank computes the amax of its part of every tile of the bucket's weights (zero
where it owns none), one all-reduce by MAX over the bucket's data-parallel group agrees all of them (and hands
every rank every tile's scale, so the scales need no gather of their own), and a tile that also spans a
tensor-parallel split (a tensorwise weight's) is reduced further over those ranks by the recipe's own amax
reduction (sharded.py), as the matmul would reduce it. Tensorwise's tile is the weight, blockwise's 128 x 128
blocks may straddle two ranks' slices: both get one device's amax, hence its scale and its FP8 bytes, bit for bit.
So a run with FP8 gathers equals one without (tests/test_fp8_param_gather.py); all of it runs on the device.

A weight's 128 x 128 blocks (and its one tensorwise scale) are the same for W and W^T, so the gathered copy
serves the forward and, transposed, the input gradient (quantize.Quantized.t). Rowwise cannot: its backward
needs the weight scaled along the other axis (config_fp8.py refuses it). The weight gradient reads no weight.

A grouped weight [experts, out, in] is quantised as its experts stacked, [experts * out, in], each expert with its
own tiles (a tensorwise scale per expert, as its matmul quantises it); the recipe reads expert e's rows. The
high-precision copy of an FP8-gathered weight is current only in the slices
this rank owns (what the optimizer and checkpoints read); under ZeRO-3 its whole storage is never regrown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.bucket_layout import Bucket, BucketLayout
from megalite.parallel.fp8.quantize import GATHERED, Quantized, amax_to_scale, encode, tiled, untiled
from megalite.parallel.fp8.recipes import Float8
from megalite.parallel.gemm import RecipeSlot
from megalite.parallel.mappings import all_gather_single
from megalite.parallel.storage import resize_storage

OwnedWeights = Callable[[nn.Parameter, int, int], torch.Tensor]  # elements [lo, hi) of a parameter, as stored


@dataclass
class _Weight:
    """One FP8-gathered weight of a bucket: its recipe (at its layer's layout), its [rows, k] shape, its tile,
    and where its tiles' amaxes sit in the bucket's amax vector."""

    param: nn.Parameter
    recipe: Float8
    tile: tuple[int, int]
    first: int  # its first tile's position in the bucket's amax vector
    tiles: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, k]: a grouped weight's experts stacked along the rows."""
        return self.param.numel() // self.param.shape[-1], self.param.shape[-1]

    @property
    def count(self) -> int:
        return self.tiles[0] * self.tiles[1]


class Float8Gathers:
    """The FP8 copies of a bucket layout's FP8 weights (`recipes`: each one's Float8 recipe, by parameter id) on
    data-parallel rank `rank` of `group`: per FP8 bucket the whole copy (`whole`, the bytes the matmuls read), this
    rank's quantised slice (`shard`) and every tile's decode scale. `persistent`: the whole copy is kept between
    steps (stages 1-2); else (ZeRO-3) it is storage gathered and freed around each use, as the parameters are."""

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None, rank: int,
                 recipes: dict[int, Float8], device: torch.device, persistent: bool) -> None:
        self.layout, self.group, self.rank, self.persistent = layout, group, rank, persistent
        self.whole: dict[int, torch.Tensor] = {}
        self.shard: dict[int, torch.Tensor] = {}
        self.amax: dict[int, torch.Tensor] = {}
        self.scale: dict[int, torch.Tensor] = {}
        self.weights: dict[int, list[_Weight]] = {}
        for bucket in (b for b in layout.buckets if b.fp8):
            self._add(bucket, recipes, device)

    def _add(self, bucket: Bucket, recipes: dict[int, Float8], device: torch.device) -> None:
        """The bucket's storage, and each weight's Quantized copy as views of it (GATHERED on the parameter)."""
        weights, first = [], 0
        for param in bucket.params:
            recipe = recipes[id(param)]
            tile = recipe.scalings["weight"].tile(tuple(param.shape[-2:]))  # an expert's own, for a grouped weight
            rows = param.numel() // param.shape[-1]
            tiles = (-(-rows // tile[0]), -(-param.shape[-1] // tile[1]))
            weights.append(_Weight(param, recipe, tile, first, tiles))
            first += tiles[0] * tiles[1]
        size = bucket.end - bucket.start
        whole = self.whole[bucket.index] = torch.zeros(size, dtype=torch.uint8, device=device)
        a, b = bucket.shard(self.rank, self.layout.replicas)
        self.shard[bucket.index] = whole[a - bucket.start:b - bucket.start] if self.layout.replicas == 1 else \
            torch.zeros(b - a, dtype=torch.uint8, device=device)
        self.amax[bucket.index] = torch.zeros(first, dtype=torch.float32, device=device)
        scale = self.scale[bucket.index] = torch.ones(first, dtype=torch.float32, device=device)
        self.weights[bucket.index] = weights
        for w in weights:
            start, end = self.layout.offsets[id(w.param)]
            dtype = w.recipe.scalings["weight"].dtype
            data = whole[start - bucket.start:end - bucket.start].view(dtype).view(w.shape)
            setattr(w.param, GATHERED, Quantized(data, scale[w.first:w.first + w.count].view(w.tiles), w.tile))

    def quantize(self, bucket: Bucket, owned: OwnedWeights) -> None:
        """Quantise this rank's slice of the bucket from the weights' stored values (`owned`), with every tile's
        scale agreed over the ranks holding parts of it (collectives: every rank of the group and of the recipes'
        groups calls this for the same buckets in the same order)."""
        amax, scale = self.amax[bucket.index], self.scale[bucket.index]
        amax.zero_()
        slices = self._owned_slices(bucket, owned)
        for w, lo, hi, values in slices:
            first_row, part = slice_amax(values, lo, hi, w.shape, w.tile)
            amax[w.first:w.first + w.count].view(w.tiles)[first_row:first_row + part.shape[0]] = part
        if self.layout.replicas > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        self._reduce_over_layout(self.weights[bucket.index], amax)
        encoders = {}
        for w in self.weights[bucket.index]:
            scaling = w.recipe.scalings["weight"]
            mine = amax[w.first:w.first + w.count].view(w.tiles)
            encoders[id(w.param)] = amax_to_scale(mine, scaling.dtype, w.recipe.power_of_two)
            scale[w.first:w.first + w.count].copy_(encoders[id(w.param)].reciprocal().reshape(-1))
        shard, (a, _) = self.shard[bucket.index], bucket.shard(self.rank, self.layout.replicas)
        for w, lo, hi, values in slices:
            dtype = w.recipe.scalings["weight"].dtype
            data = encode_slice(values, lo, hi, w.shape, w.tile, encoders[id(w.param)], dtype)
            offset = self.layout.offsets[id(w.param)][0] + lo - a
            shard[offset:offset + hi - lo] = data.view(torch.uint8)

    @staticmethod
    def _reduce_over_layout(weights: list[_Weight], amax: torch.Tensor) -> None:
        """Reduce each weight's tile amaxes (in `amax`, in place) over the ranks its layer splits it over, as its
        recipe's amax reduction does in a matmul (sharded.py: a tensorwise weight over tp or etp; a 128 x 128 block
        lies on one rank): the weights whose tiles span the same axes in one call."""
        batches: dict[tuple[str, ...], list[_Weight]] = {}
        for w in weights:
            spanned = getattr(w.recipe.amax, "spanned", None)  # LOCAL_AMAX: nothing split, nothing to reduce
            axes = spanned("weight", "forward", _whole(w)) if spanned is not None else ()
            if axes:
                batches.setdefault(axes, []).append(w)
        for batch in batches.values():
            views = [amax[w.first:w.first + w.count] for w in batch]
            agreed = batch[0].recipe.amax(torch.cat(views).view(1, -1), "weight", "forward", _whole(batch[0]))
            for view, part in zip(views, agreed.view(-1).split([w.count for w in batch])):
                view.copy_(part)

    def _owned_slices(self, bucket: Bucket, owned: OwnedWeights) -> list[tuple[_Weight, int, int, torch.Tensor]]:
        a, b = bucket.shard(self.rank, self.layout.replicas)
        slices = []
        for w in self.weights[bucket.index]:
            start, end = self.layout.offsets[id(w.param)]
            lo, hi = max(a, start) - start, min(b, end) - start
            if lo < hi:
                slices.append((w, lo, hi, owned(w.param, lo, hi)))
        return slices

    def gather(self, bucket: Bucket) -> dist.Work | None:
        """Launch the all-gather of the bucket's FP8 bytes into its whole copy (grown first, where it is freed
        between uses); nothing to gather on one replica (the shard is the whole)."""
        whole = self.whole[bucket.index]
        if not self.persistent:
            resize_storage(whole, whole.numel())
        if self.layout.replicas == 1:
            return None
        return all_gather_single(whole, self.shard[bucket.index], self.group, async_op=True)

    def free(self, bucket: Bucket) -> None:
        resize_storage(self.whole[bucket.index], 0)


def _whole(w: _Weight) -> tuple[bool, bool]:
    """Whether the weight's tile spans its rows and its columns (quantize.AmaxReduction's `whole`)."""
    scaling = w.recipe.scalings["weight"]
    return scaling.rows is None, scaling.cols is None


def slice_amax(values: torch.Tensor, lo: int, hi: int, shape: tuple[int, int],
               tile: tuple[int, int]) -> tuple[int, torch.Tensor]:
    """The amax of each tile that elements [lo, hi) of a [rows, k] weight (`values`, flat) touch, over those
    elements: (the first tile row they touch, the amaxes [tile rows touched, tile columns]). A tile's amax is the
    MAX of its slices' amaxes."""
    first_row, blocks, _, _ = _window(values, lo, hi, shape, tile)
    return first_row, blocks.abs().amax(dim=(1, 3))


def encode_slice(values: torch.Tensor, lo: int, hi: int, shape: tuple[int, int], tile: tuple[int, int],
                 scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elements [lo, hi) of a [rows, k] weight (`values`, flat) in `dtype`, each times its tile's `scale` (all the
    weight's tiles' multipliers): the bytes quantize.quantize gives those elements of the whole weight."""
    first_row, blocks, width, begin = _window(values, lo, hi, shape, tile)
    encoded = encode(blocks, scale[first_row:first_row + blocks.shape[0]], dtype)
    return untiled(encoded, (blocks.shape[0] * blocks.shape[1], width)).reshape(-1)[begin:begin + hi - lo]


def _window(values: torch.Tensor, lo: int, hi: int, shape: tuple[int, int],
            tile: tuple[int, int]) -> tuple[int, torch.Tensor, int, int]:
    """Elements [lo, hi) of a [rows, k] weight (`values`, flat) in the whole tile rows they touch, zeros elsewhere
    (a zero changes no amax), as `tiled` blocks: (the first tile row, the blocks, how many of their columns hold
    the weight, where element lo sits among those flattened). A tile spanning the weight is the slice itself, one
    row of one tile, not a weight-sized window."""
    k = shape[1]
    if tile == shape:
        return 0, values.float().reshape(1, 1, 1, -1), values.numel(), 0
    first = lo // k // tile[0]
    rows = -(-((hi - 1) // k + 1) // tile[0]) * tile[0] - first * tile[0]
    flat = torch.zeros(rows * k, dtype=torch.float32, device=values.device)
    begin = lo - first * tile[0] * k
    flat[begin:begin + hi - lo] = values.float()
    return first, tiled(flat.view(rows, k), tile), k, begin


def gathered_weights(model: nn.Module) -> dict[int, Float8]:
    """The weights train.fp8_param_gather gathers in FP8, by id, with their recipes: every matmul weight under a
    Float8 recipe whose weight tiles are the same for W and W^T (not rowwise's rows); a grouped weight where its
    experts' tiles do not straddle two experts (blockwise: out features whole 128-blocks, as the validator asks).
    A weight some other module also reads (the LM head's under train.fp8_output_head, when it is the embedding's,
    tied) is gathered in train.param_dtype: the embedding's lookup reads it whole, not as FP8 bytes."""
    slots = [m for m in model.modules() if isinstance(m, RecipeSlot) and isinstance(getattr(m, "weight", None),
                                                                                       nn.Parameter)]
    read_elsewhere = {id(p) for m in model.modules() if not isinstance(m, RecipeSlot)
                      for p in m.parameters(recurse=False)}
    return {id(m.weight): m.recipe for m in slots
            if isinstance(m.recipe, Float8) and not m.recipe.scalings["weight"].per_row
            and id(m.weight) not in read_elsewhere
            and m.weight.shape[-2] % m.recipe.scalings["weight"].tile(tuple(m.weight.shape[-2:]))[0] == 0}
