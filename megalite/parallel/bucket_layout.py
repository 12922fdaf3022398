"""Where each parameter's elements sit in the flat buffers of one replica group, and who owns what.

A pure layout: the gradient buffer, the ZeRO strategies, the distributed optimizer and the checkpoints
all read it and none of them computes offsets of its own. Parameters are laid out in reverse order of
creation, roughly the order backward produces their gradients, and cut into buckets of about
`bucket_size` elements, which reduce as soon as their gradients are in. A bucket never spans two of
ZeRO-3's gather units (`units`), so a unit's buckets hold nothing else. Nor does it mix weights gathered in FP8
(`fp8`, train.fp8_param_gather: parallel/fp8/param_gather.py) with parameters gathered in their own dtype, so that
a bucket's gather moves one kind of bytes: within each unit (or the whole chunk, without units) the parameters
gathered in their dtype come first, the FP8 weights after them, each in their order (Megatron-LM likewise keeps
FP8 parameters in buffers of their own).

Alignment, as Megatron-LM aligns: every parameter starts at a multiple of 64 elements (its view of a flat
bf16 or fp32 buffer is then 128- or 256-byte aligned, which cuBLAS and fused kernels need for their
fast paths), and every bucket ends at a multiple of lcm(replicas, 128), so that the bucket splits into
equal per-rank shards whose starts stay aligned for NCCL. The padding is a few elements per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

PARAM_ALIGNMENT = 64  # elements


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, eq=False)
class Bucket:
    """Elements [start, end) of the flat buffers, holding `params`."""

    index: int
    start: int
    end: int
    params: tuple[nn.Parameter, ...]
    fp8: bool = False  # its parameters are weights gathered in FP8

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """Replica `rank`'s slice of the bucket, in buffer coordinates."""
        per = (self.end - self.start) // size
        return self.start + rank * per, self.start + (rank + 1) * per


def _fp8_last(params: list[nn.Parameter], units: dict[int, int] | None,
              fp8: frozenset[int]) -> list[nn.Parameter]:
    """`params` with, in each run of one gather unit (all of them without units), the FP8 weights moved after
    the rest, each kind in its order."""
    if not fp8:
        return params
    runs: list[list[nn.Parameter]] = []
    for param in params:
        if not runs or (units is not None and units[id(param)] != units[id(runs[-1][-1])]):
            runs.append([])
        runs[-1].append(param)
    return [p for run in runs for p in sorted(run, key=lambda p: id(p) in fp8)]


class BucketLayout:
    """`params` in the order their gradients arrive; `replicas`: the ranks of the group that reduces them;
    `units`: each parameter's ZeRO-3 gather unit, by id; `fp8`: the ids of the weights gathered in FP8."""

    def __init__(self, params: list[nn.Parameter], bucket_size: int, replicas: int,
                 units: dict[int, int] | None = None, fp8: frozenset[int] = frozenset()) -> None:
        self.replicas, self.fp8 = replicas, fp8
        self.bucket_alignment = math.lcm(replicas, 128)
        self.offsets: dict[int, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        offset, current = 0, []
        kind = (lambda p: (None if units is None else units[id(p)], id(p) in fp8))
        for param in _fp8_last(params, units, fp8):
            if current and kind(param) != kind(current[-1]):
                offset, current = self._close(current, offset), []
            offset = _round_up(offset, PARAM_ALIGNMENT)
            self.offsets[id(param)] = (offset, offset + param.numel())
            offset += param.numel()
            current.append(param)
            if offset - (self.buckets[-1].end if self.buckets else 0) >= bucket_size:
                offset, current = self._close(current, offset), []
        if current:
            offset = self._close(current, offset)
        self.size = offset
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def _close(self, params: list[nn.Parameter], offset: int) -> int:
        start = self.buckets[-1].end if self.buckets else 0
        end = _round_up(offset, self.bucket_alignment)
        self.buckets.append(Bucket(len(self.buckets), start, end, tuple(params), id(params[0]) in self.fp8))
        return end

    def owned_ranges(self, rank: int, sharded: bool) -> list[tuple[nn.Parameter, int, int]]:
        """(param, first, last) element ranges, within each parameter, that replica `rank` owns: its shard of
        every bucket when `sharded` (the distributed optimizer), else everything."""
        owned = []
        for bucket in self.buckets:
            a, b = bucket.shard(rank, self.replicas) if sharded else (bucket.start, bucket.end)
            for param in bucket.params:
                start, end = self.offsets[id(param)]
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    owned.append((param, lo - start, hi - start))
        return owned

    def shard_position(self, param: nn.Parameter, lo: int, rank: int) -> int:
        """Where element `lo` of `param` (in a range `rank` owns) sits in the sharded layout: each bucket's
        owned shard, one after another (1/replicas of the buffer)."""
        bucket = self.bucket_of[id(param)]
        return bucket.start // self.replicas + self.offsets[id(param)][0] + lo - bucket.shard(rank, self.replicas)[0]

    def bucket_shard(self, bucket: Bucket) -> slice:
        """The bucket's owned shard in the sharded layout."""
        first = bucket.start // self.replicas
        return slice(first, first + (bucket.end - bucket.start) // self.replicas)
