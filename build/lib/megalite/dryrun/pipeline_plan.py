"""The whole pipeline's messages for one step, every rank's, replayed under NCCL's rules at full size.

A dry run simulates a few ranks in full, but a hang needs the whole pipeline: every pipeline rank runs the
real executor (parallel/schedules.py run_schedule) with a toy model, on the fake process group, recorded
(parallel/nccl_rules.py), and the records of all pp ranks are replayed together. Which messages travel, and
when, depends only on the schedule, pp, vp and the micro batch count, so the toy model shows what the real
one would send; the tests run the same toy model on real gloo ranks (tests/test_nccl_rules.py).
"""

from __future__ import annotations

import torch

from megalite.dryrun.fake_world import fake_rank, fake_tensors
from megalite.parallel.nccl_rules import CommRecorder, RankRecord, Report, replay
from megalite.parallel.p2p import PipelineComm
from megalite.parallel.pipeline_layout import PipelineStage, placement_of
from megalite.parallel.schedules import ForwardStep, run_schedule
from megalite.parallel.topology import Topology
from megalite.parallel.weight_grads import recomputed

SHAPE = (3, 1, 4)  # the toy model's activations


def toy_forward(stage: PipelineStage) -> ForwardStep:
    """Each chunk scales its input by a weight of its own (its gradient in W under a zero-bubble schedule,
    parallel/weight_grads.py): autograd for the schedule, nothing of a model."""
    weights = [torch.tensor(1.0 + stage.global_chunk(chunk) / stage.model_chunks, requires_grad=True)
               for chunk in range(stage.vp)]

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        x = torch.full(SHAPE, 1.0 + microbatch, requires_grad=True) if hidden is None else hidden
        out = recomputed(_scaled, x, weights[chunk], offset=float(chunk))
        return out.sum() if stage.is_last_chunk(chunk) else out

    return forward_step


def _scaled(x: torch.Tensor, weight: torch.Tensor, *, offset: float) -> torch.Tensor:
    return x * weight + offset


def record_schedule(name: str, microbatches: int, stage: PipelineStage, comm: PipelineComm) -> RankRecord:
    """The calls this pipeline rank makes running schedule `name` on the toy model."""
    with CommRecorder(stage.rank) as recorder, torch.set_grad_enabled(name != "forward"):
        run_schedule(name, microbatches, toy_forward(stage), stage, comm)
    return recorder.record


def check_pipeline(name: str, pp: int, vp: int, microbatches: int) -> Report:
    """Replay all `pp` ranks' calls of one step of schedule `name` under NCCL's rules."""
    records = []
    for rank in range(pp):
        with fake_rank(rank, pp), fake_tensors():
            comm = PipelineComm(Topology(rank, pp, torch.device("cpu"), pp=pp), SHAPE, torch.float32)
            stage = PipelineStage(pp, vp, rank, placement=placement_of(name))
            records.append(record_schedule(name, microbatches, stage, comm))
    return replay(records)
