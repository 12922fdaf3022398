"""Which ranks a dry run simulates: one of each role, since ranks in the same role hold and do the same.

Ranks differ by pipeline stage: the first embeds (and holds the word embeddings), the last holds the head and
the loss (and, with tied embeddings over pp > 1, the embeddings' copy; under ZB-V's V chunk order the first stage
holds both, parallel/pipeline/stage.py), the ones between hold layers only, and
a stage's place in the schedule sets how many micro batches it keeps in flight (the first the most, though with
fewer layers on the first chunk the second stage may hold more: the stage the planner expects to need the most
memory is simulated too). Within a
stage, tensor-, context-, data- and expert-parallel ranks hold equal shares and run the same schedule (context
parallelism splits every sequence into load-balanced chunks), so coordinate 0 of those axes stands for all.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import Config
from megalite.parallel.pipeline.registry import stage_layout
from megalite.parallel.topology import RankGrid
from megalite.planning.memory import memory_per_stage


@dataclass(frozen=True)
class Role:
    rank: int
    pp_rank: int
    name: str


def roles(cfg: Config, world_size: int) -> list[Role]:
    """Rank 0 of the other axes on the first and the last pipeline stage and on the stage the planner expects to
    need the most memory, or if that is the first or the last, on a middle stage (one role when pp = 1)."""
    p = cfg.parallel
    grid = RankGrid.for_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp)
    worst = max(memory_per_stage(cfg, world_size), key=lambda stage: stage.total).pp_rank
    middle = [] if 0 < worst < p.pp - 1 else [p.pp // 2]  # a layers-only stage, unless the largest is one
    stages = sorted({0, p.pp - 1, worst, *middle})
    tied = cfg.model.tied and p.pp > 1

    def name(stage: int) -> str:
        if p.pp == 1:
            return "the only stage"
        layout = stage_layout(cfg, stage)
        where = "first" if stage == 0 else "last" if stage == p.pp - 1 else "middle"
        parts = " and ".join(part for part, held in (("embedding", layout.has_embedding),
                                                      ("head and loss", layout.has_head)) if held) or "layers only"
        copy = " (tied embeddings)" if tied and parts != "layers only" else ""
        most = ", the planner's largest" if stage == worst else ""
        return f"{where} stage {stage}: {parts}{copy}{most}"

    return [Role(grid.rank({"pp": stage}), stage, name(stage)) for stage in stages]
