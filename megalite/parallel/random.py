"""Named RNG streams, so dropout inside a tensor-parallel region differs across TP ranks
(each holds other heads / other sequence positions) while dropout on replicated
activations draws the same mask on every TP rank. Works on CPU and CUDA generators.

Activation recompute must draw the masks its forward drew. torch's checkpoint restores the
default generator for the recompute but knows nothing of these streams, whose state has moved
on by then: `checkpoint_with_rng` restores them too.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

TENSOR_PARALLEL = "tensor-parallel"
_TP_SEED_OFFSET = 2718  # Megatron-LM's offset, so the TP stream never equals the default one


def named_seed(seed: int, name: str) -> int:
    """A generator seed drawn from the run's seed and a name (a parameter's global name, a mock sample's index),
    the same on every rank and layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@dataclass(frozen=True)
class RNGSnapshot:
    """The tracker at a checkpointed forward: every stream's saved state and the forks open then.
    The innermost open stream's live state is the generator's, which torch's checkpoint saves itself."""

    states: dict[str, torch.Tensor]
    forks: tuple[str, ...]


class RNGTracker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: dict[str, torch.Tensor] = {}
        self.forks: list[str] = []  # streams forked now, innermost last; the generator is drawing from the last

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        if self.device.type != "cuda":
            self.states[name] = torch.Generator().manual_seed(seed).get_state()
            return
        saved = self._get()
        torch.cuda.manual_seed(seed)
        self.states[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        """Run the block on stream `name`, then go back to the stream it interrupted (or the default one).

        Inside a fork of the same stream the block just goes on drawing from it: loading the saved
        state again would repeat the numbers the outer block drew (under SP, attention dropout would
        repeat the hidden dropout's). Switching to another stream first saves the interrupted one's
        state, so a fork of it further in continues it too."""
        outer = self.forks[-1] if self.forks else None
        if name == outer:
            yield
            return
        interrupted = self._get()
        if outer is not None:
            self.states[outer] = interrupted
        self._set(self.states[name])
        self.forks.append(name)
        try:
            yield
        finally:
            self.forks.pop()
            self.states[name] = self._get()
            self._set(interrupted if outer is None else self.states[outer])

    def snapshot(self) -> RNGSnapshot:
        return RNGSnapshot(dict(self.states), tuple(self.forks))

    @contextlib.contextmanager
    def replaying(self, snapshot: RNGSnapshot) -> Iterator[None]:
        """Run the block (a recompute) with the streams and open forks of `snapshot`, then put back the
        present ones: the recompute draws what the forward drew and the present streams do not move."""
        present = self.states, self.forks
        self.states, self.forks = dict(snapshot.states), list(snapshot.forks)
        try:
            yield
        finally:
            self.states, self.forks = present

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


def checkpoint_with_rng(function: Callable[..., Any], *args: Any, tracker: RNGTracker | None,
                        replay: Callable[[], contextlib.AbstractContextManager] | None = None) -> Any:
    """torch's non-reentrant activation checkpoint of function(*args) whose recompute also sees the
    tracker as it was at the forward (streams and open forks), so dropout draws the same masks, and runs
    inside `replay()` when given (what the forward reports is then not counted twice). Inside a compiled layer
    (selective recompute's core) it runs eager, outside the graph: torch.compile traces no checkpoint with a
    context_fn."""
    if tracker is None and replay is None:
        return checkpoint(function, *args, use_reentrant=False)
    if torch.compiler.is_compiling():
        return _eager_checkpoint(function, *args, tracker=tracker, replay=replay)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        snapshot = tracker.snapshot() if tracker is not None else None  # the streams as the forward found them

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with (tracker.replaying(snapshot) if tracker is not None else contextlib.nullcontext()), \
                    (replay() if replay is not None else contextlib.nullcontext()):
                yield

        return contextlib.nullcontext(), recompute()

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts)


@torch.compiler.disable
def _eager_checkpoint(function: Callable[..., Any], *args: Any, tracker: RNGTracker | None,
                      replay: Callable[[], contextlib.AbstractContextManager] | None) -> Any:
    return checkpoint_with_rng(function, *args, tracker=tracker, replay=replay)


def model_parallel_tracker(seed: int, tp_rank: int, device: torch.device) -> RNGTracker:
    tracker = RNGTracker(device)
    tracker.add(TENSOR_PARALLEL, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker
