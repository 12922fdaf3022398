"""Resuming a run at scale: every rank reads and verifies only its own bytes, all ranks in parallel,
and no rank waits in a timed collective while another is still reading.

Rank 0 lists the candidate checkpoints with cheap checks only (every file present at the size the
index gives) and broadcasts them: a short collective. Then each rank loads what it holds
(reader.py: its shard, its range, the CRC-32 of each block it read). A 70B checkpoint is about
1 TB; reading it takes a rank minutes on a slow file system, longer than the collective timeout,
so the ranks agree on the outcome through the c10d store instead, whose wait has its own long
timeout (`checkpoint.load_timeout_minutes`): each rank adds itself to a counter, the last one
releases the others, and the first problem any rank met is kept in one key. A damaged piece makes
every rank move on to the previous checkpoint together (`checkpoint.fallback`); any other error
stops every rank with the same message.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint.files import problem_with
from megalite.checkpoint.local import (
    TrainingState,
    checkpoint_candidates,
    give_up_unless_fallback,
    load_checkpoint,
    none_complete,
)
from megalite.checkpoint.reader import DamagedCheckpoint
from megalite.checkpoint.sharded_state import ShardedState
from megalite.parallel.topology import Topology


@dataclass
class Resumed:
    path: Path
    state: TrainingState
    rng: dict[str, torch.Tensor] | None
    optimizer_loaded: bool
    bytes_read: int
    skipped: list[str]  # damaged checkpoints passed over on the way


def _plan(load: str) -> tuple[list[tuple[str, str | None]], bool, str]:
    paths, exact = checkpoint_candidates(load)
    return [(str(p), problem_with(p, checksums=False)) for p in paths], exact, secrets.token_hex(8)


def _agree(topology: Topology, key: str, problem: tuple[str, bool] | None,
           timeout: timedelta) -> tuple[str, bool] | None:
    """The first (problem, damaged) any rank reported under `key`, once every rank has reported."""
    store = dist.distributed_c10d._get_default_store()
    if problem is not None:
        store.compare_set(f"{key}/problem", "", f"{int(problem[1])}{problem[0]}")
    if store.add(f"{key}/done", 1) == topology.world_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], timeout)
    if not store.check([f"{key}/problem"]):
        return None
    value = store.get(f"{key}/problem").decode()
    return value[1:], value[0] == "1"


def _attempt(path: Path, sharded: ShardedState, topology: Topology,
             load_optimizer: bool) -> tuple[tuple | None, Exception | None]:
    """Load one candidate: ((state, rng, optimizer loaded, bytes read), None) or (None, the error)."""
    try:
        return load_checkpoint(path, sharded, topology, load_optimizer), None
    except Exception as error:  # noqa: BLE001 - every rank must hear of it, or the others wait for this one
        return None, error


def resume(load: str, fallback: bool, sharded: ShardedState, topology: Topology, load_optimizer: bool = True,
           timeout_minutes: float = 60.0) -> Resumed | None:
    """Load the newest usable checkpoint under `load` on every rank (None: there is none yet)."""
    plan: list = [None]
    if topology.rank == 0:
        try:
            plan = [_plan(load)]
        except (OSError, ValueError) as error:
            plan = [error]
    dist.broadcast_object_list(plan, src=0)
    if isinstance(plan[0], BaseException):
        raise plan[0]
    candidates, exact, nonce = plan[0]
    skipped: list[str] = []
    for attempt, (path, problem) in enumerate(candidates):
        outcome, failure = None, (problem, True) if problem else None
        if failure is None:
            outcome, error = _attempt(Path(path), sharded, topology, load_optimizer)
            mine = None if error is None else (str(error), isinstance(error, (DamagedCheckpoint, OSError)))
            failure = _agree(topology, f"megalite/resume/{nonce}/{attempt}", mine, timedelta(minutes=timeout_minutes))
            if failure is not None:  # also where this rank's load succeeded: no state of a rejected checkpoint survives
                sharded.optimizer.state.clear()
            # not damage: every rank stops, the one that met it with its error
            if failure is not None and not failure[1]:
                raise error if error is not None else RuntimeError(f"resuming from {path} failed on another rank: "
                                                                   f"{failure[0]}")
        if failure is None:
            return Resumed(Path(path), *outcome, skipped)
        skipped.append(failure[0])
        give_up_unless_fallback(skipped, exact, fallback)
    none_complete(load, skipped)
    return None
