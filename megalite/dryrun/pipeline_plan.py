"""The whole pipeline's messages for one step, every rank's, replayed under NCCL's rules at full size.

A dry run simulates a few ranks in full, but a hang needs the whole pipeline: every pipeline rank runs the
real executor (parallel/pipeline/executor.py run_schedule) with a toy model, on the fake process group, recorded
(nccl_rules/), and the records of all pp ranks are replayed together. Which messages travel, and
when, depends only on the schedule, pp, vp and the micro batch count, so the toy model shows what the real
one would send; the tests run the same toy model on real gloo ranks (tests/test_nccl_rules.py). Its tensors
are real and tiny, not fake: a fake tensor's every operation costs a millisecond of bookkeeping, which a step of
thousands of micro batches on every pp rank multiplies into minutes. The fake group moves no bytes, so the
recorder checks the messages' sizes and order, not their contents.
"""

from __future__ import annotations

import torch

from megalite.dryrun.fake_world import fake_rank
from megalite.dryrun.nccl_rules.record import CommRecorder, RankRecord
from megalite.dryrun.nccl_rules.replay import STREAMS, Report, replay
from megalite.parallel.p2p import PipelineComm
from megalite.parallel.pipeline.executor import ForwardStep, run_schedule
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import PipelineStage
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


def record_schedule(schedule: str | ScheduleSpec, microbatches: int, stage: PipelineStage,
                    comm: PipelineComm, digests: bool = True) -> RankRecord:
    """The calls this pipeline rank makes running `schedule` on the toy model (`digests`: CommRecorder's)."""
    spec = schedule_spec(schedule)
    with CommRecorder(stage.rank, digests) as recorder, torch.set_grad_enabled(spec.trains):
        run_schedule(spec, microbatches, toy_forward(stage), stage, comm)
    return recorder.record


def check_pipeline(schedule: str | ScheduleSpec, pp: int, vp: int, microbatches: int) -> Report:
    """Replay all `pp` ranks' calls of one step of `schedule` under NCCL's rules, with the pairs' communicators
    side by side and one after another (nccl_rules/replay.py STREAMS)."""
    spec, records = schedule_spec(schedule), []
    for rank in range(pp):
        with fake_rank(rank, pp):
            comm = PipelineComm(Topology(rank, pp, torch.device("cpu"), pp=pp), SHAPE, torch.float32)
            records.append(record_schedule(spec, microbatches, spec.stage(pp, vp, rank), comm, digests=False))
    return replay(records, streams=STREAMS)
