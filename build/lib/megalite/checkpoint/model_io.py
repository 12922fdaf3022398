"""Model weights in and out of checkpoints without a process group: for converters and generation.

Tools that only need the weights (Hugging Face conversion, text generation) should not build an
optimizer or join a torchrun job; these functions read and write the same checkpoint format that
`pretrain_gpt.py` saves and loads, so a checkpoint made here resumes at any parallel layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megalite.checkpoint.files import finalize, iteration_dir, write_rank_files, write_run_files
from megalite.checkpoint.local import TrainingState, choose_checkpoint
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.sharded_state import MAIN, Piece
from megalite.config import Config
from megalite.config_cli import config_from_yaml_text, dump_yaml


def resolve_checkpoint(path: str | Path) -> Path:
    """One complete iteration's directory from either itself or a checkpoint root (its latest)."""
    found, _ = choose_checkpoint(str(path), fallback=False)
    if found is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint directory (with a `latest` file) "
                                "nor an iter_* directory")
    return found


def read_model_tensors(path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """(config, full one-device fp32 tensors by parameter name) of a checkpoint saved at any layout;
    the fp32 main weights where the run kept bf16/fp16 parameters."""
    found = resolve_checkpoint(path)
    cfg = config_from_yaml_text((found / "config.yaml").read_text(), str(found / "config.yaml"))
    reader = CheckpointReader(found)
    tensors = {}
    for name in reader.names("model"):
        main = reader.read(name, MAIN)
        tensors[name] = (main if main is not None else reader.read(name, "model")).float()
    if not tensors:
        raise FileNotFoundError(f"checkpoint {found} holds no model weights")
    return cfg, tensors


def fresh_target(path: str | Path) -> Path:
    """The output directory of a conversion, which must not hold anything yet: a conversion never overwrites."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"--save {path} already exists and is not empty; remove it or choose another directory")
    return path


def write_model_checkpoint(root: str | Path, cfg: Config, tensors: dict[str, torch.Tensor], step: int = 0,
                           consumed_samples: int = 0,
                           optimizer: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """A checkpoint of weights and config, and, where `optimizer` gives it, Adam's state of each parameter
    (exp_avg, exp_avg_sq and step, by parameter name); training resumes from it at `step` and
    `consumed_samples`, with fresh optimizer state when there is none."""
    final = iteration_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    pieces = [(Piece(name, "model", list(t.shape), None, 0, t.numel()), t.detach().reshape(-1))
              for name, t in tensors.items()]
    for name, kinds in (optimizer or {}).items():
        pieces += [(Piece(name, kind, list(t.shape), None, 0, t.numel()), t.detach().reshape(-1))
                   for kind, t in kinds.items()]
    write_rank_files(tmp, 0, pieces, rng=None)
    write_run_files(tmp, dump_yaml(cfg), TrainingState(step, consumed_samples).__dict__)
    finalize(tmp, final)
    return final
