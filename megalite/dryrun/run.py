"""A whole dry run: validate at full size, build the groups, simulate each role's rank, replay the pipeline.

How many micro batches a step simulates: all of them (`microbatches=None`), or the fewest whose schedule holds
the same peak on every simulated stage (`shortest_same_peak`): memory peaks when the most forwards are held,
which a 1F1B-style schedule reaches after its warm-up, so a long step repeats its steady state without a new
peak. Tests use the short step; tools/dry_run.py runs the whole one by default.

The simulated ranks and the pipeline's replay share nothing (each builds its own fake world), so they run side
by side (parallel/spawn.py map_in_processes): the same results, in a half or a third of the time on a machine
with two or more cores. One process per task, not per core: three ranks of about equal cost on two cores finish
in about 1.5 ranks' time when the cores are shared between the three, where two processes finish in 2 (the
third rank waits for a free process). Each extra process pays the fake-tensor cache's warm-up (a few seconds)
and holds one rank's fake world (a few hundred MB).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from dataclasses import dataclass, field

import torch

from megalite.config import Config
from megalite.config_validation import validate
from megalite.dryrun.fake_world import fake_rank
from megalite.dryrun.nccl_rules.replay import Report
from megalite.dryrun.pipeline_plan import check_pipeline
from megalite.dryrun.rank_step import RankRun, simulate_rank
from megalite.dryrun.roles import Role, roles
from megalite.dryrun.routing import check_routing
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.parallel.spawn import available_cores, map_in_processes
from megalite.parallel.topology import Topology
from megalite.planning.memory import StageMemory, peak_activations, stage_memory


@dataclass
class DryRun:
    cfg: Config  # as simulated: the global batch holds `microbatches` per data-parallel rank
    world_size: int
    microbatches: int  # simulated per step
    full_microbatches: int  # the config's
    seconds: dict[str, float]  # validation, groups (one rank's, at full size), pipeline replay
    group_bytes: int  # resident memory one rank's groups took
    pipeline: Report | None  # None at pp = 1
    ranks: list[RankRun] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # role name -> what went wrong

    def plan(self, run: RankRun, device: str = "cpu") -> StageMemory:
        """The planner's figures for that rank's stage (`device`: whose kernels it assumes)."""
        return stage_memory(self.cfg, self.world_size, run.role.pp_rank, device)

    @property
    def ok(self) -> bool:
        return not self.failures and (self.pipeline is None or self.pipeline.ok)


def with_microbatches(cfg: Config, world_size: int, count: int) -> Config:
    """`cfg` with a global batch of `count` micro batches per data-parallel rank."""
    per_step = cfg.train.micro_batch_size * cfg.data_parallel_size(world_size)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=count * per_step))


def shortest_same_peak(cfg: Config, world_size: int, stages: list[int]) -> int:
    """The fewest micro batches (a multiple of pp when interleaved) whose schedule holds, on each of `stages`,
    the same activations at its peak as the config's whole step."""
    full, p = cfg.num_microbatches(world_size), cfg.parallel
    step = p.pp if schedule_spec(p.pipeline_schedule).interleaves(p.vp) else 1  # counts it can run
    target = [peak_activations(cfg, world_size, s, "cpu") for s in stages]
    for count in range(step, full, step):
        short = with_microbatches(cfg, world_size, count)
        if [peak_activations(short, world_size, s, "cpu") for s in stages] == target:
            return count
    return full


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_groups(cfg: Config, world_size: int, rank: int = 0) -> tuple[float, int]:
    """Seconds and resident bytes rank `rank` spends making its groups at full size (every rank makes every
    group of the layout, in the same order, as torch requires)."""
    with fake_rank(rank, world_size):
        before, start = _resident_bytes(), time.perf_counter()
        topology = Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel, cfg.model.num_experts > 0)
        seconds, grown = time.perf_counter() - start, _resident_bytes() - before
        del topology
    return seconds, grown


def dry_run(cfg: Config, world_size: int, microbatches: int | str = "all", sites: int = 0,
            workers: int | None = None) -> DryRun:
    """Dry-run `cfg` at `world_size` ranks, simulating `microbatches` per step: a number, "all" (the config's)
    or "peak" (`shortest_same_peak`); `sites`: name the code that made the largest tensors at each peak;
    `workers`: processes that simulate ranks at once (default: one per task where there is more than one core, see
    the module docstring; 1 runs everything in this process).
    Raises ConfigError for an invalid config, ValueError for a layout the dry run cannot simulate."""
    start = time.perf_counter()
    validate(cfg, world_size)
    seconds = {"validation": time.perf_counter() - start}
    check_routing(cfg.model)
    full, chosen = cfg.num_microbatches(world_size), roles(cfg, world_size)
    count = {"all": full, "peak": None}.get(microbatches, microbatches)
    count = shortest_same_peak(cfg, world_size, [role.pp_rank for role in chosen]) if count is None else count
    simulated = with_microbatches(cfg, world_size, count)
    seconds["groups"], group_bytes = build_groups(cfg, world_size)
    report = DryRun(simulated, world_size, count, full, seconds, group_bytes, None)
    p = cfg.parallel
    pipeline = [(_replay, (p.pipeline_schedule, p.pp, p.vp, full))] if p.pp > 1 else []
    tasks = [(_simulate, (simulated, world_size, role, count, sites)) for role in chosen] + pipeline
    results = map_in_processes(tasks, workers or (len(tasks) if available_cores() > 1 else 1))
    for role, result in zip(chosen, results, strict=False):
        if isinstance(result, RankRun):
            report.ranks.append(result)
        else:
            report.failures[role.name] = result
    if pipeline:
        report.pipeline, seconds["pipeline"] = results[-1]
    return report


def _simulate(cfg: Config, world_size: int, role: Role, count: int, sites: int) -> RankRun | str:
    """simulate_rank's run, or what went wrong where: a layout that crashes is the finding, reported."""
    try:
        return simulate_rank(cfg, world_size, role, count, sites)
    except Exception as error:
        return "".join(traceback.format_exception(error)[-6:])


def _replay(schedule: str, pp: int, vp: int, microbatches: int) -> tuple[Report, float]:
    """check_pipeline's report and the seconds it took."""
    start = time.perf_counter()
    return check_pipeline(schedule, pp, vp, microbatches), time.perf_counter() - start
