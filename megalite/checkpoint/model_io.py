"""Model weights in and out of checkpoints without a process group: for converters and generation.

Tools that only need the weights (Hugging Face conversion, text generation) should not build an
optimizer or join a torchrun job; these functions read and write the same checkpoint format that
`pretrain_gpt.py` saves and loads, so a checkpoint made here resumes at any parallel layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megalite.checkpoint.local import FORMAT_VERSION, LATEST, _atomic_write_text, _fsync_tree, _load_stages, iteration_dir, latest_checkpoint
from megalite.config import Config
from megalite.config_cli import config_from_yaml_text, dump_yaml
from safetensors.torch import save_file


def resolve_checkpoint(path: str | Path) -> Path:
    """One iteration's directory from either itself or a checkpoint root (its latest)."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint directory (with a `latest` file) nor an iter_* directory")
    return found


def read_model_tensors(path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """(config, full one-device tensors by parameter name) of a checkpoint saved at any layout."""
    found = resolve_checkpoint(path)
    cfg = config_from_yaml_text((found / "config.yaml").read_text(), str(found / "config.yaml"))
    tensors = _load_stages(found, "model")
    if not tensors:
        raise FileNotFoundError(f"checkpoint {found} holds no model weights (model_*.safetensors)")
    return cfg, tensors


def write_model_checkpoint(root: str | Path, cfg: Config, tensors: dict[str, torch.Tensor], step: int = 0) -> Path:
    """A checkpoint of weights and config only; training resumes from it with fresh optimizer state."""
    final = iteration_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model_000.safetensors")
    (tmp / "config.yaml").write_text(dump_yaml(cfg))
    state = {"format_version": FORMAT_VERSION, "step": step, "consumed_samples": 0, "loss_scaler": {}, "wandb_run_id": None}
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    _fsync_tree(tmp)
    tmp.replace(final)
    _atomic_write_text(Path(root) / LATEST, f"{step}\n")
    return final
