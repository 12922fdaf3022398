"""The registered pipeline schedules, by the name parallel.pipeline_schedule gives them, and what the config's
choice decides: each rank's stage (its chunk order) and the layers it holds.

Every schedule's facts are in its ScheduleSpec (spec.py); this is the one list of them. A test (or a plugin)
registers another with `register`, and validation, the planner, the executor and the dry run take it as they
take these.
"""

from __future__ import annotations

from megalite.config import Config, ParallelConfig
from megalite.parallel.pipeline.dualpipe import DUALPIPE_V
from megalite.parallel.pipeline.one_f_one_b import FORWARD, GPIPE, ONE_F_ONE_B
from megalite.parallel.pipeline.ops import ScheduleOp
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import PipelineStage, StageLayout
from megalite.parallel.pipeline.zero_bubble import ZB_H1, ZB_V

SCHEDULES: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Make `spec` selectable as parallel.pipeline_schedule={spec.name}."""
    if spec.name in SCHEDULES and SCHEDULES[spec.name] != spec:
        raise ValueError(f"a pipeline schedule named {spec.name!r} is registered already")
    SCHEDULES[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    SCHEDULES.pop(name, None)


for _spec in (FORWARD, GPIPE, ONE_F_ONE_B, ZB_H1, ZB_V, DUALPIPE_V):
    register(_spec)


def training_schedules() -> list[str]:
    """The names parallel.pipeline_schedule accepts: every registered schedule that trains."""
    return sorted(name for name, spec in SCHEDULES.items() if spec.trains)


def schedule_spec(schedule: str | ScheduleSpec) -> ScheduleSpec:
    """The spec registered as `schedule` (a spec is its own)."""
    if isinstance(schedule, ScheduleSpec):
        return schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; the registered schedules are {sorted(SCHEDULES)}")
    return SCHEDULES[schedule]


def schedule_ops(schedule: str | ScheduleSpec, pp: int, vp: int, rank: int, microbatches: int) -> list[ScheduleOp]:
    """The operations of pipeline rank `rank` under `schedule`, in execution order."""
    return schedule_spec(schedule).rank_ops(pp, vp, rank, microbatches)


def bubble_fraction(schedule: str | ScheduleSpec, pp: int, vp: int, microbatches: int, t_f: float = 1.0,
                    t_b: float = 1.0, t_w: float = 1.0, t_fb: float | None = None) -> float:
    """`schedule`'s idle share of the ideal step, given a rank's forward, input-gradient and weight-gradient
    times and a paired forward and whole backward's (None: their sum; only the ratios matter)."""
    return schedule_spec(schedule).bubble(pp, vp, microbatches, t_f, t_b, t_w, t_fb)


def pipeline_stage(parallel: ParallelConfig, pp_rank: int) -> PipelineStage:
    """Pipeline rank `pp_rank`'s stage under the config's schedule."""
    return schedule_spec(parallel.pipeline_schedule).stage(parallel.pp, parallel.vp, pp_rank)


def stage_layout(cfg: Config, pp_rank: int) -> StageLayout:
    """Pipeline rank `pp_rank`'s layout as the config asks (the whole model when parallel.pp = 1)."""
    p = cfg.parallel
    if p.pp == 1:
        return StageLayout.single(cfg.model.num_layers)
    return StageLayout.of(pipeline_stage(p, pp_rank), cfg.model.num_layers, p.first_stage_layers,
                          p.last_stage_layers)
