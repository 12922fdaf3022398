"""Which Megatron-LM checkpoint a path names, and in which format.

A Megatron checkpoint root holds `latest_checkpointed_iteration.txt` (an iteration number, or `release`) and
`iter_0000100/` (or `release/`) directories. Inside one: the legacy `torch` format has one
`mp_rank_TT[_PPP]/model_optim_rng.pt` per tensor/pipeline rank; `torch_dist` is a torch.distributed.checkpoint
directory (`.metadata`, `__*.distcp`, `metadata.json` saying `torch_dist`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from megalite.checkpoint.megatron.legacy import read_legacy
from megalite.checkpoint.megatron.state import MegatronState
from megalite.checkpoint.megatron.torch_dist import read_torch_dist

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_directory(path: Path) -> Path:
    """The iteration directory `path` names: itself, or the one its tracker file names."""
    if not path.is_dir():
        raise FileNotFoundError(f"--load {path} does not exist; give a Megatron-LM checkpoint directory")
    tracker = path / TRACKER
    if not tracker.is_file():
        return path
    text = tracker.read_text().strip()
    if text != "release" and not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
    found = path / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not found.is_dir():
        raise FileNotFoundError(f"{tracker} names iteration {text} but {found} does not exist")
    return found


def read_megatron(path: str | Path, check: Callable[[argparse.Namespace], None],
                  with_optimizer: bool = True) -> MegatronState:
    """Everything megalite carries over from a Megatron-LM checkpoint (root or iteration directory), the optimizer
    state only `with_optimizer`; `check` sees Megatron's args first, before the tensors are read (to refuse a
    model megalite cannot compute)."""
    found = iteration_directory(Path(path))
    if (found / ".metadata").is_file():
        return read_torch_dist(found, check, with_optimizer)
    if any(found.glob("mp_rank_*/model_optim_rng.pt")):
        return read_legacy(found, check, with_optimizer)
    raise FileNotFoundError(f"{found} is not a Megatron-LM checkpoint: it has neither a .metadata file (torch_dist) "
                            "nor mp_rank_*/model_optim_rng.pt files (legacy torch format)")
