"""Named RNG streams, so dropout inside a tensor-parallel region differs across TP ranks
(each holds other heads / other sequence positions) while dropout on replicated
activations draws the same mask on every TP rank. Works on CPU and CUDA generators."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

TENSOR_PARALLEL = "tensor-parallel"
_TP_SEED_OFFSET = 2718  # Megatron-LM's offset, so the TP stream never equals the default one


class RNGTracker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: dict[str, torch.Tensor] = {}

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
        """Run the block on stream `name`, then restore the default stream."""
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


def model_parallel_tracker(seed: int, tp_rank: int, device: torch.device) -> RNGTracker:
    tracker = RNGTracker(device)
    tracker.add(TENSOR_PARALLEL, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker
