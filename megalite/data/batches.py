"""Cut a global batch into the micro batches one data-parallel rank processes.

Micro batch m of rank r holds samples consumed + m*mb*dp + r*mb + [0, mb), so a global
batch is the same set of samples for every (dp, micro batch size) split of it; only
the order of summation differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class TokenDataset(Protocol):
    def __getitem__(self, index: int) -> torch.Tensor: ...


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in (self.tokens, self.labels, self.loss_mask)))


def make_batch(samples: list[torch.Tensor]) -> Batch:
    stacked = torch.stack(samples)
    tokens, labels = stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()
    return Batch(tokens, labels, torch.ones_like(labels, dtype=torch.float32))


def rank_microbatches(dataset: TokenDataset, first_sample: int, global_batch_size: int, micro_batch_size: int, dp: int, dp_rank: int) -> list[Batch]:
    per_step = micro_batch_size * dp
    batches = []
    for m in range(global_batch_size // per_step):
        start = first_sample + m * per_step + dp_rank * micro_batch_size
        batches.append(make_batch([dataset[i] for i in range(start, start + micro_batch_size)]))
    return batches
