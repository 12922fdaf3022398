"""Turn samples of seq_length + 1 tokens into training batches: inputs, shifted labels,
loss mask and (optionally) position ids that restart at every document.

Follows Megatron-LM: with eod_mask_loss, predictions made from an end-of-document token
carry no loss; with reset_position_ids, positions count from 0 after each such token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megalite.data.mtp_targets import MTPTargets


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    mtp: MTPTargets | None = None  # multi-token prediction's inputs and targets (data/mtp_targets.py)

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        mtp = None if self.mtp is None else self.mtp.apply(move)
        return Batch(move(self.tokens), move(self.labels), move(self.loss_mask), move(self.position_ids), mtp)

    def select(self, positions: torch.Tensor) -> Batch:
        """The batch restricted to these sequence positions (context parallelism's part of every sample),
        with their position ids: positions keep counting where they were, documents restart where they did."""
        pick = lambda t: t.index_select(-1, positions)  # noqa: E731
        ids = positions.expand(self.tokens.shape[0], -1) if self.position_ids is None else pick(self.position_ids)
        mtp = None if self.mtp is None else self.mtp.apply(pick)
        return Batch(pick(self.tokens), pick(self.labels), pick(self.loss_mask), ids, mtp)

    def pin_memory(self) -> Batch:
        """Called by DataLoader(pin_memory=True) so host-to-GPU copies can overlap compute."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        mtp = None if self.mtp is None else self.mtp.apply(pin)
        return Batch(pin(self.tokens), pin(self.labels), pin(self.loss_mask), pin(self.position_ids), mtp)


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Position of each token within its document: 0 right after every eod, else counting up."""
    index = torch.arange(tokens.shape[1]).expand_as(tokens)
    after_eod = torch.zeros_like(tokens, dtype=torch.bool)
    after_eod[:, 1:] = tokens[:, :-1] == eod
    starts = torch.where(after_eod, index, torch.zeros_like(index))
    return index - torch.cummax(starts, dim=1).values


@dataclass(frozen=True)
class BatchMaker:
    """The collate function; a picklable object so DataLoader worker processes can run it."""

    eod: int | None = None
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    def __call__(self, samples: Sequence[np.ndarray]) -> Batch:
        stacked = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))
        tokens, labels = stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod] = 0.0
        positions = document_positions(tokens, self.eod) if self.reset_position_ids else None
        return Batch(tokens, labels, loss_mask, positions)
