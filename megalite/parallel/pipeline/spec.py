"""A pipeline schedule, described once: everything the rest of megalite asks of it.

A `ScheduleSpec` holds a schedule's op-list builder (each rank's operations in order), the formula of its bubble,
whether it splits each backward into B and W, the chunk order its stages hold their chunks in, the number of
chunks per rank it needs, whether it needs pipeline parallelism at all and how many micro batches per rank.
Config validation, the planner, the stage layout, the executor and the dry run read these fields and nothing
else of a schedule; none of them names one. The specs are registered in registry.py; a new schedule (DualPipeV
was one) is its op lists and its spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.parallel.pipeline.ops import Bubble, F, Op, OpList, ScheduleOp
from megalite.parallel.pipeline.stage import LOOP, ChunkOrder, PipelineStage


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule.

    name: the value of parallel.pipeline_schedule that selects it. ops: (pp, vp, rank, microbatches) -> the rank's
    operations in order. bubble: its idle share of the ideal step (None: it trains nothing, evaluation's
    forwards). split_backward: each backward is split into B (input gradients) and W (weight gradients, queued
    by B: weight_grads.py), and the model is built so (model/split_backward.py). chunk_order: which chunks each
    rank holds (stage.py). vp: the chunks per rank it needs (None: any; with vp > 1 it then interleaves, its
    micro batches going through the chunks in groups of pp, Megatron-LM's rule); its chunk order's when that
    needs one. needs_pipeline: it only makes sense at pp > 1. min_microbatches_per_rank: it needs at least this
    many micro batches per pipeline rank (DualPipeV's 2). doc: one line for --help.
    """

    name: str
    ops: OpList
    bubble: Bubble | None
    doc: str = ""
    split_backward: bool = False
    chunk_order: ChunkOrder = LOOP
    vp: int | None = None
    needs_pipeline: bool = False
    min_microbatches_per_rank: int = 0

    def __post_init__(self) -> None:
        if self.vp is None and self.chunk_order.vp is not None:
            object.__setattr__(self, "vp", self.chunk_order.vp)

    @property
    def trains(self) -> bool:
        """It runs backwards (every schedule but evaluation's forwards)."""
        return self.bubble is not None

    def interleaves(self, vp: int) -> bool:
        """At `vp` chunks per rank its micro batches go through the chunks in groups of pp (so their number must
        be a multiple of pp)."""
        return vp > 1 and self.vp is None

    def stage(self, pp: int, vp: int, rank: int) -> PipelineStage:
        """Pipeline rank `rank`'s stage under this schedule: the one place a stage gets its chunk order."""
        return PipelineStage(pp, vp, rank, order=self.chunk_order)

    def rank_ops(self, pp: int, vp: int, rank: int, microbatches: int) -> list[ScheduleOp]:
        """Pipeline rank `rank`'s operations, in execution order."""
        if self.vp is not None and vp != self.vp:
            raise ValueError(self.vp_problem(vp))
        if microbatches < self.min_microbatches_per_rank * pp:
            raise ValueError(self.problems(pp, vp, microbatches)[-1])
        return self.ops(pp, vp, rank, microbatches)

    def vp_problem(self, vp: int) -> str:
        return (f"parallel.pipeline_schedule={self.name} runs {self.vp} model chunk{'s' if self.vp > 1 else ''} per "
                f"pipeline rank: set parallel.vp={self.vp} (not {vp})")

    def problems(self, pp: int, vp: int, microbatches: int | None) -> list[str]:
        """What stops this schedule from running at pp, vp and `microbatches` (None: not known), each naming the
        config fields to change."""
        errors = []
        if self.vp is not None and vp != self.vp:
            errors.append(self.vp_problem(vp))
        if self.needs_pipeline and pp == 1:
            errors.append(f"parallel.pipeline_schedule={self.name} fills pipeline bubbles, and parallel.pp=1 has "
                          "none: choose a schedule that does not split the backward, or set parallel.pp > 1")
        if self.interleaves(vp) and microbatches is not None and microbatches % pp:
            errors.append(f"interleaved {self.name} (parallel.vp={vp}) needs the number of micro batches "
                          f"({microbatches} = global batch / (micro batch * dp)) to be a multiple of "
                          f"parallel.pp={pp}; change train.global_batch_size")
        if microbatches is not None and microbatches < self.min_microbatches_per_rank * pp:
            errors.append(f"parallel.pipeline_schedule={self.name} needs at least {self.min_microbatches_per_rank} "
                          f"micro batches per pipeline rank: {self.min_microbatches_per_rank * pp} at "
                          f"parallel.pp={pp}, not {microbatches} (= global batch / (micro batch * dp)); raise "
                          "train.global_batch_size or lower train.micro_batch_size")
        return errors

    def label(self, vp: int) -> str:
        """Its name in tables, "interleaved" where it interleaves."""
        return f"interleaved {self.name}" if self.interleaves(vp) else self.name

    def forward_only(self) -> ScheduleSpec:
        """Evaluation's schedule on this schedule's stages: forwards only, in this schedule's chunk order."""
        return dataclasses.replace(self, name=f"{self.name} (forwards)", ops=forwards, bubble=None, doc="",
                                   split_backward=False, needs_pipeline=False, min_microbatches_per_rank=0)


def forwards(pp: int, vp: int, rank: int, m: int) -> list[Op]:
    """Forwards only, for evaluation: each micro batch through this rank's chunks in turn."""
    return [Op(F, chunk, i) for i in range(m) for chunk in range(vp)]
