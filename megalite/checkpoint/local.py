"""Single-layout checkpoints: `iter_{step:07d}/` directories plus a `latest` file.

Model weights go to safetensors; optimizer state and RNG states go through torch.save and
come back with `weights_only=True`, so loading never runs pickled code. A checkpoint is
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
from safetensors.torch import load_file, save_file

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


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class TrainingState:
    """Everything beyond tensors that a resumed run needs to continue exactly."""

    step: int
    consumed_samples: int
    loss_scaler: dict[str, Any]
    wandb_run_id: str | None = None


def save_checkpoint(root: str, state: TrainingState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config_yaml: str, device: torch.device) -> Path:
    """Write one complete checkpoint and point `latest` at it; returns its directory."""
    final = iteration_dir(root, state.step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(device), tmp / "rng.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / "state.json").write_text(json.dumps({"format_version": FORMAT_VERSION, **state.__dict__}, indent=2))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(Path(root) / LATEST, f"{state.step}\n")
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


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> TrainingState:
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {name} is missing; resume from an earlier iter_* directory")
    weights = load_file(path / "model.safetensors", device=str(device))
    expected = model.state_dict()
    mismatched = [f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}" for k, v in expected.items() if k in weights and weights[k].shape != v.shape]
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if missing or unexpected or mismatched:
        raise ValueError(
            f"checkpoint {path} does not fit this model (was it saved with another model config?): "
            f"missing {missing}, unexpected {unexpected}, shape mismatches {mismatched}"
        )
    model.load_state_dict(weights)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    set_rng_state(torch.load(path / "rng.pt", weights_only=True), device)
    fields = json.loads((path / "state.json").read_text())
    fields.pop("format_version", None)
    return TrainingState(**fields)
