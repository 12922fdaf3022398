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
from megalite.parallel.pipeline_layout import PipelineStage
from megalite.parallel.schedules import ForwardStep, run_schedule
from megalite.parallel.topology import Topology

SHAPE = (3, 1, 4)  # the toy model's activations


def toy_forward(stage: PipelineStage) -> ForwardStep:
    """Each chunk scales its input by a weight of its own: autograd for the schedule, nothing of a model."""
    weights = torch.linspace(1.0, 2.0, stage.vp * stage.pp).view(stage.vp, stage.pp)[:, stage.rank].clone()
    weights.requires_grad_()

    def forward_step(chunk: int, microbatch: int, hidden: torch.Tensor | None) -> torch.Tensor:
        x = torch.full(SHAPE, 1.0 + microbatch) if hidden is None else hidden
        out = x * weights[chunk] + chunk
        return out.sum() if stage.is_last_chunk(chunk) else out

    return forward_step


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
            records.append(record_schedule(name, microbatches, PipelineStage(pp, vp, rank), comm))
    return replay(records)
