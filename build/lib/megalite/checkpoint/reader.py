"""Reading a published checkpoint: each rank reads only the bytes of what it holds, and checks them.

A rank holds, of each global tensor, one shard (split along one or several axes of its placement, or
the whole tensor) and, under the distributed optimizer, one flat range of it (`Target`). When the
checkpoint was saved with the same splits, the saved pieces are flat ranges of the same shards, and only
the overlapping sub-ranges are read, with safetensors' slicing. When the splits differ, the rows the
target needs are read from each saved shard that holds some of them and re-cut.

Every piece carries CRC-32s of its bytes in blocks of `block_bytes` (files.py), so a rank verifies
exactly the blocks it read; the file-level CRC of checkpoints written before per-block CRCs is
checked once per file instead. A reader counts the bytes it read (`bytes_read`).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

INDEX = "index.json"


class DamagedCheckpoint(ValueError):
    """A piece whose bytes do not match the index, or that is missing: resume from an older checkpoint."""


Shards = tuple[tuple[int, int, int, int], ...]  # each split as [dim, blocks, index, count], applied in order


@dataclass(frozen=True)
class Target:
    """What a rank holds of a global tensor of `shape`: its shard (each split [dim, blocks, index, count] of
    its placement, in order; none: the whole tensor) and the flat range [lo, hi) of that shard."""

    shape: tuple[int, ...]
    shards: Shards
    lo: int
    hi: int

    @classmethod
    def whole(cls, shape: list[int] | tuple[int, ...]) -> Target:
        return cls(tuple(shape), (), 0, int(torch.Size(shape).numel()))


def saved_shards(recorded: list | None) -> Shards:
    """A piece's shards as index.json records them: a list of splits, or (checkpoints written before pieces
    could be split along several axes) one split or null."""
    if not recorded:
        return ()
    return (tuple(recorded),) if isinstance(recorded[0], int) else tuple(tuple(split) for split in recorded)


def _rows(size: int, blocks: int, index: int, count: int) -> torch.Tensor:
    """Positions, along the split dimension, of the rows of shard `index` (see placement.shard)."""
    block, per = size // blocks, size // (blocks * count)
    local = torch.arange(per * blocks)
    return (local // per) * block + index * per + local % per


def _global_indices(shape: tuple[int, ...], shards: Shards) -> list[torch.Tensor]:
    """For each dimension, the global positions (ascending) of the shard's entries along it."""
    indices = [torch.arange(size) for size in shape]
    for dim, blocks, index, count in shards:
        indices[dim] = indices[dim][_rows(len(indices[dim]), blocks, index, count)]
    return indices


def _shard_key(entry: dict[str, Any]) -> tuple[int, ...]:
    return tuple(split[2] for split in saved_shards(entry["shard"]))


def _layout(shards: Shards) -> list[tuple[int, int, int]]:
    """What makes two shardings cut a tensor the same way: each split's dim, blocks and count."""
    return [(dim, blocks, count) for dim, blocks, _, count in shards]


def _grid(positions: list[torch.Tensor], first: int = 0) -> tuple[torch.Tensor, ...]:
    """Advanced-indexing tensors selecting the outer product of per-dimension positions (dim 0 shifted by
    `first`)."""
    n = len(positions)
    return tuple((p - first if d == 0 else p).view(*[-1 if i == d else 1 for i in range(n)])
                 for d, p in enumerate(positions))


class CheckpointReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        index = json.loads((path / INDEX).read_text())
        self.files: dict[str, dict[str, Any]] = index["files"]
        self.pieces: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for entry in index["pieces"]:
            self.pieces.setdefault((entry["name"], entry["kind"]), []).append(entry)
        self._open: dict[str, Any] = {}
        self._verified_files: set[str] = set()
        self.bytes_read = 0

    def names(self, kind: str = "model") -> dict[str, list[int]]:
        """Global shapes of the tensors saved with this kind, by name."""
        return {name: entries[0]["shape"] for (name, k), entries in self.pieces.items() if k == kind}

    def kinds(self) -> set[str]:
        return {kind for _, kind in self.pieces}

    def read(self, name: str, kind: str) -> torch.Tensor | None:
        """The whole global tensor, or None when the checkpoint has no such piece."""
        entries = self.pieces.get((name, kind))
        return (None if not entries
                else self.read_part(name, kind, Target.whole(entries[0]["shape"])).view(entries[0]["shape"]))

    def read_part(self, name: str, kind: str, target: Target) -> torch.Tensor | None:
        """The flat range `target` holds of tensor `name`, or None when the checkpoint has no such piece."""
        entries = self.pieces.get((name, kind))
        if not entries:
            return None
        if _layout(saved_shards(entries[0]["shard"])) == _layout(target.shards):
            index = tuple(split[2] for split in target.shards)
            return self._flat_range([e for e in entries if _shard_key(e) == index], target.lo, target.hi,
                                    f"{name}/{kind}")
        return self._recut(name, kind, entries, target)

    def _recut(self, name: str, kind: str, entries: list[dict[str, Any]], target: Target) -> torch.Tensor:
        """The target's range, re-cut from the saved shards (the layouts split the tensor differently). Only the
        rows (first dimension) the range touches are read, each a contiguous range of every saved shard."""
        shape, wanted = target.shape, _global_indices(target.shape, target.shards)
        inner = math.prod(len(index) for index in wanted[1:])
        r0, r1 = target.lo // inner, -(-target.hi // inner)
        wanted[0] = wanted[0][r0:r1]
        out = torch.empty(0)
        filled = 0
        by_shard: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        for entry in entries:
            by_shard.setdefault(_shard_key(entry), []).append(entry)
        for mine in by_shard.values():
            held = _global_indices(shape, saved_shards(mine[0]["shard"]))
            inside = [torch.isin(want, have) for want, have in zip(wanted, held)]
            if not all(where.any() for where in inside):
                continue
            local = [torch.searchsorted(have, want[where]) for want, have, where in zip(wanted, held, inside)]
            a, b = int(local[0].min()), int(local[0].max()) + 1
            old_inner = math.prod(len(index) for index in held[1:])
            old = self._flat_range(mine, a * old_inner, b * old_inner, f"{name}/{kind}")
            old = old.view(b - a, *(len(index) for index in held[1:]))
            part = old[_grid(local, first=a)]
            if out.numel() == 0:
                out = torch.empty([len(index) for index in wanted], dtype=old.dtype)
            out[_grid([where.nonzero().flatten() for where in inside])] = part
            filled += part.numel()
        if filled != math.prod(len(index) for index in wanted):
            raise DamagedCheckpoint(f"{self.path}: {name}/{kind} lacks elements this rank needs; the checkpoint is "
                                    "incomplete")
        return out.reshape(-1)[target.lo - r0 * inner:target.hi - r0 * inner]

    def _flat_range(self, entries: list[dict[str, Any]], lo: int, hi: int, what: str) -> torch.Tensor:
        """Elements [lo, hi) of one saved shard, from the pieces (flat ranges of it) that overlap."""
        out, covered = None, 0
        for e in entries:
            a, b = max(lo, e["lo"]), min(hi, e["hi"])
            if a >= b:
                continue
            values = self._piece_range(e, a - e["lo"], b - e["lo"])
            if out is None:
                out = torch.empty(hi - lo, dtype=values.dtype)
            out[a - lo:b - lo] = values
            covered += b - a
        if covered != hi - lo:
            raise DamagedCheckpoint(f"{self.path}: {what} has {covered} of the {hi - lo} elements this rank needs; "
                                    "the checkpoint is incomplete")
        return out

    def _file(self, name: str) -> Any:
        if name not in self._open:
            try:
                self._open[name] = safe_open(self.path / name, framework="pt")
            except SafetensorError as error:  # a damaged header
                raise DamagedCheckpoint(f"checkpoint {self.path}: {name} is corrupt ({error})") from error
        return self._open[name]

    def _piece_range(self, entry: dict[str, Any], a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of one piece, after checking the CRC-32 of every block they touch."""
        data = self._file(entry["file"]).get_slice(entry["key"])
        if "crc32_blocks" not in entry:  # written before per-block checksums: check the whole file once
            self._verify_file(entry["file"])
            self.bytes_read += (b - a) * data[0:1].element_size()
            return data[a:b]
        size = data[0:1].element_size()
        block = entry["block_bytes"] // size
        first, last = a // block, -(-b // block)
        values = data[first * block:min(last * block, entry["hi"] - entry["lo"])]
        self.bytes_read += values.numel() * size
        for i, part in enumerate(values.split(block), start=first):
            if zlib.crc32(part.contiguous().view(torch.uint8).numpy()) != entry["crc32_blocks"][i]:
                raise DamagedCheckpoint(f"checkpoint {self.path}: {entry['file']} is corrupt (CRC-32 differs from "
                                        f"the index in {entry['name']}/{entry['kind']}, block {i})")
        return values[a - first * block:b - first * block]

    def _verify_file(self, name: str) -> None:
        if name in self._verified_files:
            return
        crc = 0
        with open(self.path / name, "rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
                self.bytes_read += len(chunk)
        if crc != self.files[name]["crc32"]:
            raise DamagedCheckpoint(f"checkpoint {self.path}: {name} is corrupt (CRC-32 differs from the index)")
        self._verified_files.add(name)

    def rng(self, rank: int) -> dict[str, torch.Tensor] | None:
        """This rank's RNG streams (rank 0's when the checkpoint was written by fewer ranks)."""
        folder = self.path / "rng"
        if not folder.is_dir():
            return None
        file = folder / f"rank_{rank:05d}.pt"
        return torch.load(file if file.is_file() else folder / "rank_00000.pt", weights_only=True)
