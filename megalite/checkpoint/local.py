"""Saving and resuming a training run: which checkpoint to load, and saves that may run in the
background (the format is in files.py, the per-rank pieces in sharded_state.py).

A save is collective. Every rank copies its pieces to host memory (the only stall under
`checkpoint.async_save`), then writes them, in a background thread when asynchronous. The save
is published (index, rename, `latest`, pruning) by rank 0 only after every rank reported its
files written: at the first step boundary where all ranks agree (`poll`), or at the next save
or the end of training (`wait`). A crash before that leaves the previous checkpoint current.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megalite.checkpoint.compatibility import check_fits
from megalite.checkpoint.files import (
    LATEST,
    complete_iterations,
    finalize,
    iteration_dir,
    problem_with,
    write_rank_files,
    write_run_files,
)
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.sharded_state import ShardedState
from megalite.config import ModelConfig
from megalite.errors import InvalidInput, MissingInput
from megalite.parallel.random import RNGTracker
from megalite.parallel.topology import Topology, synchronize


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
    """Everything beyond tensors that a resumed run needs to continue exactly (the LR schedule and
    the data order are functions of the step and of consumed_samples)."""

    step: int
    consumed_samples: int
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    wandb_run_id: str | None = None
    skipped_steps: int = 0

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


WRITER_THREAD = "megalite-checkpoint-writer"


@dataclass
class _Pending:
    final: Path
    tmp: Path
    thread: threading.Thread | None
    error: BaseException | None = None


class Checkpointer:
    """Saves of one run into `root`; `async_save` writes in the background, `keep_last` prunes."""

    def __init__(self, root: str, topology: Topology, async_save: bool = False, keep_last: int | None = None) -> None:
        self.root, self.topology, self.async_save, self.keep_last = Path(root), topology, async_save, keep_last
        self.pending: _Pending | None = None
        self._host: list[torch.Tensor] = []

    def save(self, state: TrainingState, sharded: ShardedState, config_yaml: str, rng: dict[str, torch.Tensor]) -> Path:
        """Start a checkpoint of the current state; returns its (future) directory. Collective."""
        self.wait()
        t, final = self.topology, iteration_dir(self.root, state.step)
        tmp = final.with_name(final.name + ".tmp")
        if t.rank == 0:
            for stale in self.root.glob("iter_*.tmp"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_run_files(tmp, config_yaml, state.__dict__)
        dist.barrier()
        found = sharded.pieces()
        pieces = list(zip([piece for piece, _ in found], self._host_copies([tensor for _, tensor in found])))
        rng = {k: v.clone() for k, v in rng.items()}
        self.pending = _Pending(final, tmp, None)
        if self.async_save:
            self.pending.thread = threading.Thread(target=self._write, args=(self.pending, pieces, rng), daemon=True,
                                                   name=WRITER_THREAD)
            self.pending.thread.start()
        else:
            self._write(self.pending, pieces, rng)
            self.wait()
        return final

    def _host_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` in host memory, in the buffers of the previous save when the pieces are the same
        (a save waits for the previous one's files first), pinned on a GPU so every copy is asynchronous, with
        one synchronisation at the end instead of one per piece."""
        device = self.topology.device
        if [(h.shape, h.dtype) for h in self._host] != [(t.shape, t.dtype) for t in tensors]:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        synchronize(device)
        return self._host

    def _write(self, pending: _Pending, pieces: list, rng: dict[str, torch.Tensor]) -> None:
        try:
            write_rank_files(pending.tmp, self.topology.rank, pieces, rng)
        except BaseException as error:  # reported on the training thread by poll / wait
            pending.error = error

    def poll(self) -> Path | None:
        """At a step boundary: publish the pending save if every rank finished writing it (collective)."""
        if self.pending is None:
            return None
        running = self.pending.thread is not None and self.pending.thread.is_alive()
        return self._publish_if(self.topology.max_over_ranks([float(running)])[0] == 0)

    def wait(self) -> Path | None:
        """Block until the pending save is written everywhere, then publish it (collective)."""
        if self.pending is None:
            return None
        if self.pending.thread is not None:
            self.pending.thread.join()
        return self._publish_if(True)

    def abandon(self) -> None:
        """A failing run: let the background write finish (no thread left writing into the checkpoint
        directory) but publish nothing, which would need every rank. The unpublished `.tmp` directory is
        ignored on resume and removed by the next save."""
        if self.pending is not None and self.pending.thread is not None:
            self.pending.thread.join()
        self.pending = None

    def _publish_if(self, done: bool) -> Path | None:
        if not done:
            return None
        pending, self.pending = self.pending, None
        if self.topology.max_over_ranks([float(pending.error is not None)])[0]:
            detail = f": {pending.error!r}" if pending.error is not None else " on another rank (see its log)"
            raise RuntimeError(f"writing checkpoint {pending.final} failed{detail}; the previous checkpoint is intact")
        if self.topology.rank == 0:
            finalize(pending.tmp, pending.final, self.keep_last)
        dist.barrier()
        return pending.final


def _candidates(root: Path) -> list[Path]:
    """Checkpoints of `root` to try, newest first, starting at the one `latest` names."""
    pointer, found = root / LATEST, complete_iterations(root)[::-1]
    if not pointer.exists():
        return found
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise InvalidInput(f"{pointer}: expected an iteration number, found {text!r}; fix or delete the file")
    latest = iteration_dir(root, int(text))
    if not latest.is_dir():
        raise MissingInput(f"{pointer} names iteration {text} but {latest} does not exist; "
                           "point it at an existing iter_* directory")
    return [latest] + [p for p in found if int(p.name[5:]) < int(text)]


def checkpoint_candidates(load: str) -> tuple[list[Path], bool]:
    """The checkpoints to try, in order, and whether `load` names one iteration directory exactly (then
    only it); a root gives its latest complete one first, then older ones (the fallbacks)."""
    path = Path(load)
    if path.name.startswith("iter_") or (path / "state.json").exists():
        if not path.is_dir():
            raise MissingInput(f"checkpoint.load={load} does not exist; fix the path")
        return [path], True
    return (_candidates(path) if path.is_dir() else []), False


def give_up_unless_fallback(problems: list[str], exact: bool, fallback: bool) -> None:
    """After a damaged candidate: stop unless the next one may be tried."""
    if exact:
        raise InvalidInput(f"{problems[-1]}; resume from another iter_* directory")
    if not fallback:
        raise InvalidInput(f"{problems[-1]}; set checkpoint.fallback=true to resume from the previous complete "
                           "checkpoint")


def none_complete(load: str, problems: list[str]) -> None:
    if problems:
        raise InvalidInput(f"no complete checkpoint in {load}: " + "; ".join(problems))


def choose_checkpoint(load: str, fallback: bool, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and the damaged ones skipped on the way (every file's size, and
    with `checksums` its CRC-32, checked). None: no checkpoint yet."""
    paths, exact = checkpoint_candidates(load)
    skipped: list[str] = []
    for candidate in paths:
        problem = problem_with(candidate, checksums)
        if problem is None:
            return candidate, skipped
        skipped.append(problem)
        give_up_unless_fallback(skipped, exact, fallback)
    none_complete(load, skipped)
    return None, []


def load_checkpoint(path: Path, sharded: ShardedState, topology: Topology, load_optimizer: bool = True,
                    model: ModelConfig | None = None, model_names: set[str] | None = None,
                    ) -> tuple[TrainingState, dict[str, torch.Tensor] | None, bool, int]:
    """Restore what this rank holds of the model and optimizer, whatever layout saved them; returns the
    training state, this rank's RNG streams (None in a weights-only checkpoint), whether optimizer
    state was loaded and the bytes this rank read. Refused before loading (compatibility.py) when the
    checkpoint's model differs from `model` (the run's config) where the weights cannot follow, or holds
    tensors of other shapes, fewer, or (given `model_names`, the whole model's) more."""
    reader = CheckpointReader(path)
    check_fits(path, reader.names("model"), sharded.shapes(), model_names, model)
    loaded_optimizer = sharded.load(reader, load_optimizer)
    state = TrainingState.from_json((path / "state.json").read_text())
    return state, reader.rng(topology.rank), loaded_optimizer, reader.bytes_read
