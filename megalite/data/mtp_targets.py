"""Multi-token prediction's inputs and targets, cut from a batch over its whole training window.

Depth k (1..D) at position i combines the hidden state of position i with the embedding of token t_{i+k} and
predicts t_{i+k+1}: its input tokens are the labels shifted k - 1 to the left, its targets the labels shifted k,
so each depth has one target fewer inside the window (the window's last positions are masked, never filled from
the next sample). A depth-k prediction counts only where the main loss counts at each of positions i..i+k, which
keeps it inside one document under data.eod_mask_loss (no chain through an end-of-document token), and, with
position ids that restart at each document (data.reset_position_ids), only where positions i..i+k are in one
document.

They are cut from the whole sequence before context parallelism takes each rank's part of it (Batch.select), so
a rank whose chunk ends where another's begins has the tokens of that next chunk without any communication,
whichever load-balanced chunk order context parallelism uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class MTPTargets:
    """Per depth (the first dimension, D), [batch, seq] each: the input tokens, the target tokens, the loss mask."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    def apply(self, change: Callable[[torch.Tensor], torch.Tensor]) -> MTPTargets:
        """The targets with `change` applied to each tensor (a move, a selection of positions along the last dim)."""
        return MTPTargets(change(self.tokens), change(self.labels), change(self.loss_mask))


def _shifted(values: torch.Tensor, by: int) -> torch.Tensor:
    """values [batch, seq] moved `by` positions to the left, the last `by` positions zero."""
    if by == 0:
        return values
    return torch.cat([values[:, by:], torch.zeros_like(values[:, :by])], dim=1)


def mtp_targets(labels: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor | None,
                depths: int) -> MTPTargets:
    """The `depths` depths' targets of a batch's whole sequences: labels, loss_mask [batch, seq] (the main
    loss's); position_ids [batch, seq] when they restart at each document, else None."""
    tokens, targets, masks = [], [], []
    mask = loss_mask
    for k in range(1, depths + 1):
        tokens.append(_shifted(labels, k - 1))
        targets.append(_shifted(labels, k))
        mask = mask * _shifted(loss_mask, k)
        if position_ids is not None:  # positions i..i+k in one document: no restart between them
            mask = mask * (_shifted(position_ids, k) - position_ids == k)
        masks.append(mask)
    return MTPTargets(torch.stack(tokens), torch.stack(targets), torch.stack(masks))
