"""Validation loss and perplexity over a fixed set of held-out global batches."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megalite.data.batches import Batch
from megalite.data.build import TrainingData
from megalite.data.loader import micro_batches
from megalite.parallel.pipeline.executor import run_schedule
from megalite.training.build import Trainer
from megalite.training.step import local_batches, microbatch_forward


@torch.no_grad()
def evaluate(trainer: Trainer, data: TrainingData) -> tuple[float, float]:
    """(mean per-token loss, perplexity) over the first train.eval_iters global batches of the validation
    set; the value is known on the last pipeline stage (NaN elsewhere)."""
    cfg, topology, model = trainer.cfg, trainer.topology, trainer.model
    model.eval()
    per_step = cfg.num_microbatches(topology.world_size)
    end = cfg.train.eval_iters * cfg.batch_size(topology.world_size)
    totals = torch.zeros(2, device=topology.device, dtype=torch.float64)

    def add_losses(out: torch.Tensor, batch: Batch) -> torch.Tensor:
        totals.add_(torch.stack(((out * batch.loss_mask).sum(), batch.loss_mask.sum())).double())
        return out

    with micro_batches(data.valid, data.maker, 0, end, cfg.train.micro_batch_size, topology.dp, topology.dp_rank,
                       cfg.data.num_workers, topology.device) as stream:
        for _ in range(cfg.train.eval_iters):
            batches = local_batches(trainer, [next(stream) for _ in range(per_step)])
            pipeline = trainer.pipeline
            run_schedule(pipeline.spec.forward_only(), per_step, microbatch_forward(trainer, batches, add_losses),
                         pipeline.stage, pipeline.comm)
    dist.all_reduce(totals, group=topology.dp_cp_group)
    model.train()
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    return loss, math.exp(min(loss, 700.0))
