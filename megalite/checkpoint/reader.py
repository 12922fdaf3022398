"""Reading a published checkpoint: each rank reads only the bytes of what it holds, and checks them.

A rank holds, of each global tensor, one tensor-parallel shard (or the whole tensor) and, under
the distributed optimizer, one flat range of it (`Target`). When the checkpoint was saved with
the same tensor-parallel split, the saved pieces are flat ranges of the same shards, and only
the overlapping sub-ranges are read, with safetensors' slicing. When the split differs, the rows
the target needs are read from each saved shard that holds some of them and re-cut along the
split dimension.

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


@dataclass(frozen=True)
class Target:
    """What a rank holds of a global tensor of `shape`: the tensor-parallel shard [dim, blocks, index,
    count] (None: the whole tensor) and the flat range [lo, hi) of that shard."""

    shape: tuple[int, ...]
    shard: tuple[int, int, int, int] | None
    lo: int
    hi: int

    @classmethod
    def whole(cls, shape: list[int] | tuple[int, ...]) -> "Target":
        return cls(tuple(shape), None, 0, int(torch.Size(shape).numel()))

    def shard_shape(self) -> list[int]:
        return _shard_shape(list(self.shape), self.shard)


def _shard_shape(shape: list[int], shard: list[int] | tuple[int, ...] | None) -> list[int]:
    if shard:
        shape = list(shape)
        shape[shard[0]] //= shard[3]
    return shape


def _global_rows(size: int, blocks: int, index: int, count: int) -> torch.Tensor:
    """Global indices, along the split dimension, of the rows of shard `index` (see layers.shard)."""
    block, per = size // blocks, size // (blocks * count)
    local = torch.arange(per * blocks)
    return (local // per) * block + index * per + local % per


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
        saved = entries[0]["shard"]
        same_split = (saved is None and target.shard is None) or (
            saved is not None and target.shard is not None
            and list(saved[:2]) + [saved[3]] == [*target.shard[:2], target.shard[3]])
        if same_split:
            index = target.shard[2] if target.shard else 0
            return self._flat_range([e for e in entries if (e["shard"][2] if e["shard"] else 0) == index],
                                    target.lo, target.hi, f"{name}/{kind}")
        return self._resplit(name, kind, entries, target)

    def _resplit(self, name: str, kind: str, entries: list[dict[str, Any]], target: Target) -> torch.Tensor:
        """The target's range, re-cut from the saved shards along the split dimension. Only the rows
        (first dimension) the range touches are read, each a contiguous range of every saved shard."""
        shape, saved = list(target.shape), entries[0]["shard"]
        dim, count = (target.shard or saved)[0], saved[3] if saved else 1
        new_shape, old_shape = target.shard_shape(), _shard_shape(shape, saved)
        inner, old_inner = math.prod(new_shape[1:]), math.prod(old_shape[1:])
        r0, r1 = target.lo // inner, -(-target.hi // inner)
        wanted = _global_rows(shape[dim], *target.shard[1:]) if target.shard else torch.arange(shape[dim])
        wanted = wanted[r0:r1] if dim == 0 else wanted
        out = None
        for index in range(count):
            rows = _global_rows(shape[dim], saved[1], index, count) if saved else torch.arange(shape[dim])
            where = torch.isin(wanted, rows)
            if not where.any():
                continue
            local = torch.searchsorted(rows, wanted[where])  # rows ascend
            a, b = (int(local.min()), int(local.max()) + 1) if dim == 0 else (r0, r1)
            mine = [e for e in entries if (e["shard"][2] if e["shard"] else 0) == index]
            old = self._flat_range(mine, a * old_inner, b * old_inner, f"{name}/{kind}").view(b - a, *old_shape[1:])
            if out is None:
                out = torch.empty(r1 - r0, *new_shape[1:], dtype=old.dtype)
            out.index_copy_(dim, where.nonzero().flatten(), old.index_select(dim, local - a if dim == 0 else local))
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
