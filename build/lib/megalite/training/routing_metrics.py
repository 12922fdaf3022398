"""What the mixture-of-experts routers did between two log steps, for the metrics file and W&B: the balancing
terms (as the one-device model would report them: each a mean over the global batch's micro batches, summed
over layers), each layer's load imbalance (the busiest expert's tokens over the mean, 1 when balanced) and,
with an expert capacity, the fraction of (token, choice) pairs dropped.

Each step's figures are added up on the device (no host read); at a log step one all-reduce over every rank
sums them (each MoE layer lives on one pipeline stage; under SP and cp each rank routed its own tokens and
reported its own share of the terms) and one read brings them to the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.model.aux_losses import AuxLosses
from megalite.model.moe.router import BALANCING_TERMS
from megalite.parallel.topology import Topology


class RoutingMetrics:
    def __init__(self, cfg: ModelConfig, topology: Topology) -> None:
        self.layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        self.experts, self.topology = cfg.num_experts, topology
        self.capacity = cfg.moe_capacity_factor is not None
        self.sums: torch.Tensor | None = None
        self.steps = 0

    def add_step(self, reported: AuxLosses) -> None:
        zero = torch.zeros((), device=self.topology.device)
        terms = [reported.totals.get(name, zero) for name in BALANCING_TERMS]
        loads = [reported.loads.get(layer, zero.expand(self.experts)) for layer in self.layers]
        dropped = reported.dropped if reported.dropped is not None else zero
        values = torch.cat([torch.stack([*terms, dropped]), *loads])
        self.sums = values if self.sums is None else self.sums + values
        self.steps += 1

    def read(self, microbatches: int) -> dict[str, float]:
        """The figures since the last read (`microbatches` per step on each data-parallel rank), and restart."""
        if self.sums is None:
            return {}
        sums, steps, self.sums, self.steps = self.sums, self.steps, None, 0
        if self.topology.world_size > 1:
            dist.all_reduce(sums)
        values = sums.tolist()
        t = self.topology
        # Each cp rank reports its terms cp times over (model/moe/router.py), and the data-parallel ranks' micro
        # batches are the global batch's: the mean over them is the one-device figure.
        mean = steps * microbatches * t.dp * t.cp
        record = {name: value / mean for name, value in zip(BALANCING_TERMS, values)}
        dropped, loads = values[len(BALANCING_TERMS)], values[len(BALANCING_TERMS) + 1:]
        if self.capacity:
            record["moe_dropped_fraction"] = dropped / max(sum(loads), 1.0)
        for n, layer in enumerate(self.layers):
            counts = loads[n * self.experts:(n + 1) * self.experts]
            record[f"moe_load_imbalance/layer_{layer}"] = max(counts) * self.experts / max(sum(counts), 1.0)
        return record
