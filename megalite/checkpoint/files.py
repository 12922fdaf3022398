"""The on-disk checkpoint format: one directory per iteration, written so that a crash at any
moment leaves the previous checkpoint intact and `latest` pointing at a complete one.

    root/latest                      the last complete iteration's number, replaced atomically
    root/iter_0000100/
        config.yaml  state.json      the run's config as given; step, consumed samples, loss scaler, W&B id
        resolved.yaml                the same config with every derived default filled in (config_resolved.py)
        index.json                   every piece (global name, kind, shard, range, file, key, CRC-32
                                     of each block of BLOCK_BYTES) and every file's size and CRC-32,
                                     written last
        rank_00003.safetensors       the pieces rank 3 owns (sharded_state.py)
        rng/rank_00003.pt            rank 3's RNG streams (tensors only: loaded with weights_only)

Each rank writes its files into `iter_0000100.tmp/` plus a small `rank_XXXXX.json` saying what
it wrote; once every rank is done, rank 0 merges those into index.json, fsyncs, renames the
directory and only then rewrites `latest`. Nothing here is pickled code: safetensors, JSON,
YAML, and RNG tensors loaded with `weights_only=True`. Reading is in reader.py.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megalite.checkpoint.reader import INDEX
from megalite.checkpoint.sharded_state import Piece
from megalite.config_cli import config_from_yaml_text
from megalite.config_resolved import RESOLVED_HEADER, resolved_yaml

FORMAT_VERSION = 2
LATEST = "latest"
BLOCK_BYTES = 4 << 20  # a resuming rank reads and verifies whole blocks: at most two more per piece than it needs


def iteration_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def fsync_tree(path: Path) -> None:
    for file in sorted(path.rglob("*")) + [path]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_files(tmp: Path, rank: int, pieces: list[tuple[Piece, torch.Tensor]],
                     rng: dict[str, torch.Tensor] | None) -> None:
    """One rank's share of a checkpoint (runs in a background thread under async save)."""
    name = f"rank_{rank:05d}.safetensors"
    files, listed = {}, []
    if pieces:
        path = tmp / name
        save_file({str(i): t.contiguous() for i, (_, t) in enumerate(pieces)}, str(path))  # streams, releasing the GIL
        readable_as_umask(path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        files[name] = {"bytes": path.stat().st_size, "crc32": _crc32(path)}
        listed = [{**piece.to_json(), "file": name, "key": str(i), "block_bytes": BLOCK_BYTES,
                   "crc32_blocks": _block_crcs(t)}
                  for i, (piece, t) in enumerate(pieces)]
    if rng is not None:
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng, tmp / "rng" / f"rank_{rank:05d}.pt")
    atomic_write_text(tmp / f"rank_{rank:05d}.json", json.dumps({"files": files, "pieces": listed}))


CONFIG_HEADER = ("# The run's config as given (null: derived at start-up; resolved.yaml beside it has the values).\n"
                 "# Reuse it with --config.\n")


def _umask() -> int:
    """The process's umask, read without setting it where Linux tells it (os.umask can only be read by
    changing it, which races with a thread creating a file: an asynchronous save's writer)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_as_umask(path: Path) -> None:
    """Give `path` the mode a new file gets (0666 less the umask): safetensors 0.8 writes 0600, which a team
    sharing a cluster's file system could not read."""
    os.chmod(path, 0o666 & ~_umask())


def write_run_files(tmp: Path, config_yaml: str, state: dict[str, Any]) -> None:
    """The run's config as given, its resolved view and the training state (rank 0's share of a checkpoint)."""
    (tmp / "config.yaml").write_text(CONFIG_HEADER + config_yaml)
    resolved = resolved_yaml(config_from_yaml_text(config_yaml, str(tmp / "config.yaml")))
    (tmp / "resolved.yaml").write_text(RESOLVED_HEADER + resolved)
    (tmp / "state.json").write_text(json.dumps({"format_version": FORMAT_VERSION, **state}, indent=2))


def finalize(tmp: Path, final: Path, keep_last: int | None = None) -> None:
    """Merge the ranks' listings into index.json, make the directory durable, publish it, and prune."""
    files, pieces = {}, []
    for listing in sorted(tmp.glob("rank_*.json")):
        part = json.loads(listing.read_text())
        files |= part["files"]
        pieces += part["pieces"]
        listing.unlink()
    (tmp / INDEX).write_text(json.dumps({"format_version": FORMAT_VERSION, "files": files, "pieces": pieces}))
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / LATEST, f"{int(final.name.split('_')[1])}\n")
    if keep_last:
        for old in complete_iterations(final.parent)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


def complete_iterations(root: Path) -> list[Path]:
    """Published iteration directories, oldest first (temporary ones are never listed)."""
    found = [p for p in root.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def problem_with(path: Path, checksums: bool = True) -> str | None:
    """Why `path` is not a complete checkpoint (a missing, truncated or corrupt file), or None."""
    for name in ("config.yaml", "state.json", INDEX):
        if not (path / name).is_file():
            return f"checkpoint {path} is incomplete: {name} is missing"
    index = json.loads((path / INDEX).read_text())
    for name, expected in index["files"].items():
        file = path / name
        if not file.is_file():
            return f"checkpoint {path} is incomplete: {name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return (f"checkpoint {path}: {name} is truncated ({file.stat().st_size} bytes, "
                    f"index says {expected['bytes']})")
        if checksums and _crc32(file) != expected["crc32"]:
            return f"checkpoint {path}: {name} is corrupt (CRC-32 differs from the index)"
    return None


def _block_crcs(tensor: torch.Tensor) -> list[int]:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return [zlib.crc32(raw[i:i + BLOCK_BYTES].numpy()) for i in range(0, raw.numel(), BLOCK_BYTES)]


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc
