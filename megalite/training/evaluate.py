"""Validation loss and perplexity over a fixed set of held-out global batches."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import Config
from megalite.data.build import TrainingData
from megalite.data.loader import micro_batches
from megalite.parallel.topology import Topology
from megalite.training.step import precision_context


@torch.no_grad()
def evaluate(model: nn.Module, data: TrainingData, cfg: Config, topology: Topology) -> tuple[float, float]:
    """(mean per-token loss, perplexity) over the first train.eval_iters global batches of the validation set."""
    model.eval()
    end = cfg.train.eval_iters * cfg.batch_size(topology.world_size)
    batches = micro_batches(data.valid, data.maker, 0, end, cfg.train.micro_batch_size, topology.dp, topology.dp_rank,
                            cfg.data.num_workers, topology.device)
    totals = torch.zeros(2, device=topology.device, dtype=torch.float64)
    for batch in batches:
        batch = batch.to(topology.device)
        with precision_context(cfg.train.precision, topology.device):
            losses = model(batch.tokens, batch.labels, batch.position_ids)
        totals += torch.stack(((losses * batch.loss_mask).sum(), batch.loss_mask.sum())).double()
    dist.all_reduce(totals, group=topology.dp_group)
    model.train()
    loss = float(totals[0] / totals[1])
    return loss, math.exp(min(loss, 700.0))
