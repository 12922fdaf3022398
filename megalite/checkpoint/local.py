"""Single-layout checkpoints: `iter_{step:07d}/` directories plus a `latest` file.

Model weights and optimizer state go to safetensors as full tensors named by parameter
(see full_state.py), so a checkpoint loads at any tensor-parallel size; RNG states go
through torch.save and come back with `weights_only=True`, so loading never runs pickled
code. A checkpoint is
written into a temporary directory, fsynced and renamed, and `latest` is replaced only
afterwards, so a crash mid-save leaves the previous checkpoint intact and pointed to.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megalite.checkpoint.full_state import FullState
from megalite.parallel.random import RNGTracker
from megalite.parallel.topology import Topology

FORMAT_VERSION = 1
LATEST = "latest"


def iteration_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def _fsync_tree(path: Path) -> None:
    for file in sorted(path.rglob("*")) + [path]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state(device: torch.device, tracker: RNGTracker | None) -> dict[str, torch.Tensor]:
    """This rank's default RNG streams plus its named tensor-parallel streams."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if tracker is not None:
        state |= {f"tracker/{name}": s for name, s in tracker.state_dict().items()}
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device, tracker: RNGTracker | None) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    named = {k.split("/", 1)[1]: v for k, v in state.items() if k.startswith("tracker/")}
    if tracker is not None and named:
        tracker.load_state_dict(named)


@dataclass
class TrainingState:
    """Everything beyond tensors that a resumed run needs to continue exactly."""

    step: int
    consumed_samples: int
    loss_scaler: dict[str, Any]
    wandb_run_id: str | None = None


def save_checkpoint(root: str, state: TrainingState, full: FullState, config_yaml: str, topology: Topology, rng: dict[str, torch.Tensor]) -> Path:
    """Write one complete checkpoint and point `latest` at it; returns its directory. Collective.

    Data-parallel replica 0 gathers full tensors over its tensor-parallel groups and tensor-parallel
    rank 0 of each pipeline stage writes that stage's (model_PPP / optimizer_PPP); every rank writes
    its own RNG streams.
    """
    final = iteration_dir(root, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if topology.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    tensors = (full.model_tensors(), *full.optimizer_tensors()) if topology.dp_rank == 0 or full.every_rank_gathers else None
    dist.barrier()
    torch.save(rng, tmp / "rng" / f"rank_{topology.rank:05d}.pt")
    if topology.dp_rank == 0 and topology.tp_rank == 0:
        model, optimizer, groups = tensors
        save_file(model, tmp / f"model_{topology.pp_rank:03d}.safetensors")
        save_file(optimizer, tmp / f"optimizer_{topology.pp_rank:03d}.safetensors")
    if topology.rank == 0:
        (tmp / "optimizer_groups.json").write_text(json.dumps(groups, indent=2))
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "state.json").write_text(json.dumps({"format_version": FORMAT_VERSION, **state.__dict__}, indent=2))
    dist.barrier()
    if topology.rank == 0:
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(Path(root) / LATEST, f"{state.step}\n")
    dist.barrier()
    return final


def latest_checkpoint(root: str) -> Path | None:
    """The directory `latest` points to, None when `root` holds no checkpoint yet."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer}: expected an iteration number, found {text!r}; fix or delete the file")
    path = iteration_dir(root, int(text))
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names iteration {text} but {path} does not exist; point it at an existing iter_* directory")
    return path


def _load_stages(path: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors of `kind` (model / optimizer), by one-device name."""
    tensors = {}
    for file in sorted(path.glob(f"{kind}_*.safetensors")):
        tensors |= load_file(file)
    return tensors


def load_checkpoint(path: Path, full: FullState, topology: Topology) -> tuple[TrainingState, dict[str, torch.Tensor] | None]:
    """Restore model and optimizer (resliced for this rank's layout); returns the training state and
    this rank's RNG streams (rank 0's when the checkpoint was written by fewer ranks)."""
    weights_only = not (path / "optimizer_groups.json").exists() and not (path / "rng").exists()
    required = ("model_000.safetensors", "state.json") + (() if weights_only else ("optimizer_000.safetensors", "optimizer_groups.json", "rng/rank_00000.pt"))
    for name in required:
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {name} is missing; resume from an earlier iter_* directory")
    weights = _load_stages(path, "model")
    expected = full.model_tensors_shapes()
    mismatched = [f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v)}" for k, v in expected.items() if k in weights and weights[k].shape != v]
    missing = sorted(expected.keys() - weights.keys())
    if missing or mismatched:
        raise ValueError(
            f"checkpoint {path} does not fit this model (was it saved with another model config?): "
            f"missing {missing}, shape mismatches {mismatched}"
        )
    full.load_model(weights)
    fields = json.loads((path / "state.json").read_text())
    fields.pop("format_version", None)
    if weights_only:  # written by model_io (e.g. converted from Hugging Face): fresh optimizer, same RNG
        return TrainingState(**fields), None
    full.load_optimizer(_load_stages(path, "optimizer"), json.loads((path / "optimizer_groups.json").read_text()))
    rng_file = path / "rng" / f"rank_{topology.rank:05d}.pt"
    rng = torch.load(rng_file if rng_file.is_file() else path / "rng" / "rank_00000.pt", weights_only=True)
    return TrainingState(**fields), rng
