"""Named RNG streams, so dropout inside a tensor-parallel region differs across TP ranks
(each holds other heads / other sequence positions) while dropout on replicated
activations draws the same mask on every TP rank. Works on CPU and CUDA generators.

Activation recompute must draw the masks its forward drew. torch's checkpoint restores the
default generator for the recompute but knows nothing of these streams, whose state has moved
on by then: `checkpoint_with_rng` restores them too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

TENSOR_PARALLEL = "tensor-parallel"
_TP_SEED_OFFSET = 2718  # Megatron-LM's offset, so the TP stream never equals the default one


class RNGTracker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: dict[str, torch.Tensor] = {}
        self.active: set[str] = set()

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
        """Run the block on stream `name`, then restore the default stream. Inside a fork of the same
        stream the block just goes on drawing from it: loading the stream's saved state again would
        repeat the numbers the outer block already drew."""
        if name in self.active:
            yield
            return
        saved = self._get()
        self._set(self.states[name])
        self.active.add(name)
        try:
            yield
        finally:
            self.active.discard(name)
            self.states[name] = self._get()
            self._set(saved)

    @contextlib.contextmanager
    def replaying(self, states: dict[str, torch.Tensor]) -> Iterator[None]:
        """Run the block with the streams as `states` (a snapshot), then put back where they are now."""
        current = dict(self.states)
        self.states = dict(states)
        try:
            yield
        finally:
            self.states = current

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


def checkpoint_with_rng(function: Callable[..., Any], *args: Any, tracker: RNGTracker | None) -> Any:
    """torch's non-reentrant activation checkpoint of function(*args) whose recompute also sees the
    tracker's streams as they were at the forward, so dropout draws the same masks."""
    if tracker is None:
        return checkpoint(function, *args, use_reentrant=False)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), tracker.replaying(dict(tracker.states))

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts)


def model_parallel_tracker(seed: int, tp_rank: int, device: torch.device) -> RNGTracker:
    tracker = RNGTracker(device)
    tracker.add(TENSOR_PARALLEL, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker
