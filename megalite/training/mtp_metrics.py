"""Multi-token prediction's losses between two log steps, for the metrics file and W&B beside the main loss:
`mtp_{k}_loss`, depth k's cross-entropy as its loss term counts it (summed over its predictions, over the main
loss's token count: model/mtp.py), the mean over the steps since the last read.

Each step's figures stay on the device: each rank's depth sums (the head's stage counted them, tensor-parallel
ranks each the same ones, context- and data-parallel ranks each their tokens' share) over the step's global token
count, added up; at a log step one all-reduce over every rank sums them and one read brings them to the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.model.aux_losses import AuxLosses
from megalite.parallel.topology import Topology


class MTPMetrics:
    def __init__(self, depths: int, topology: Topology) -> None:
        self.depths, self.topology = depths, topology
        self.sums: torch.Tensor | None = None
        self.steps = 0

    def add_step(self, reported: AuxLosses, tokens: torch.Tensor) -> None:
        """A step's depth sums (`reported`'s totals `mtp_1`...), `tokens` its global count of main-loss tokens."""
        zero = torch.zeros((), device=self.topology.device)
        sums = torch.stack([reported.totals.get(f"mtp_{k}", zero) for k in range(1, self.depths + 1)])
        values = sums.double() / tokens.double().clamp(min=1.0)
        self.sums = values if self.sums is None else self.sums + values
        self.steps += 1

    def read(self) -> dict[str, float]:
        """The mean of each depth's loss since the last read, and restart."""
        if self.sums is None:
            return {}
        sums, steps, self.sums, self.steps = self.sums, self.steps, None, 0
        if self.topology.world_size > 1:
            dist.all_reduce(sums)
        values = (sums / (steps * self.topology.tp)).tolist()
        return {f"mtp_{k}_loss": value for k, value in enumerate(values, start=1)}
