"""The dry run's findings as text: each simulated rank's memory beside the planner's, its communication per
step, the whole pipeline's replay, the cost of building the groups, and a verdict per rank.

The planner is asked for the CPU's figures (planning/activations.py Widths: the kernels the dry run runs); its
CUDA figure, which differs only in what CUDA's kernels keep (its fused RMSNorm, a norm's fp32 statistics, the
split-backward norms' fp32 outputs under autocast), is shown beside it. A rank fits when its
measured peak plus the planner's reserve (CUDA context, NCCL, fragmentation) fits the GPU's memory.
"""

from __future__ import annotations

from collections import defaultdict

from megalite.dryrun.live_bytes import KINDS
from megalite.dryrun.rank_step import RankRun
from megalite.dryrun.run import DryRun
from megalite.planning.memory import StageMemory
from megalite.planning.plan import GPUS, RESERVED_GIB

GIB = 2**30
TOLERANCE = 0.05  # measured vs planned: a larger difference is reported for a fix


def planned(stage: StageMemory) -> dict[str, float]:
    """The planner's figures under the dry run's kinds."""
    return {"weights": stage.weights, "gradients": stage.gradients, "main_weights": stage.main_weights,
            "optimizer": stage.optimizer, "activations": stage.activations, "transient": stage.transient}


def difference(run: RankRun, stage: StageMemory) -> float:
    """(measured - planned) / planned of the rank's total."""
    return (run.total - stage.total) / stage.total if stage.total else 0.0


def needed(run: RankRun) -> float:
    """GiB the rank needs: its step's peak or its build's, whichever is larger, and the planner's reserve."""
    return max(run.total, run.build[0]) / GIB + RESERVED_GIB


def fits(run: RankRun, gpu: str) -> bool:
    return needed(run) <= GPUS[gpu][0] / 1024


def _memory_lines(report: DryRun, run: RankRun) -> list[str]:
    stage, cuda = report.plan(run), report.plan(run, "cuda")
    plan = planned(stage)
    lines = [f"  {'memory at the peak':<22}{'measured':>12}{'planner':>12}"]
    for kind in KINDS:
        lines.append(f"  {kind:<22}{run.memory.get(kind, 0) / GIB:>10.3f} G{plan[kind] / GIB:>10.3f} G")
    lines.append(f"  {'total':<22}{run.total / GIB:>10.3f} G{stage.total / GIB:>10.3f} G"
                 f"  ({difference(run, stage):+.1%}; planner with CUDA's kernels {cuda.total / GIB:.3f} G)")
    if run.host:
        lines.append(f"  host (offloaded)      {run.host / GIB:>10.3f} G")
    lines += [f"  Muon's update as planned for this rank: {step.peak / GIB:.3f} G held in the optimizer step, "
              f"{step.flops:.3e} Newton-Schulz FLOPs, {step.sent / 2**20:.1f} MiB sent to owners, "
              f"{step.back / 2**20:.1f} MiB returned" for step in stage.muon if step.rank == run.role.rank]
    lines += [f"    {nbytes / GIB:8.3f} G {kind:<13} made at {site}" for nbytes, kind, site in run.largest]
    device, host = run.build
    lines.append(f"  building it takes up to {device / GIB:.3f} G on the device, and draws up to {host / GIB:.3f} G at "
                 "once in host memory (each parameter at full shape: model/init.py)")
    return lines


def communication(run: RankRun) -> list[tuple[str, str, int, int]]:
    """(group, call, count, bytes: of the sends, or a collective's whole buffer) of the rank's step, the most
    bytes first."""
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for call in run.calls:
        entry = totals[(call.desc or call.comm, call.name)]
        entry[0] += 1
        entry[1] += call.payload
    return sorted(((g, n, c, b) for (g, n), (c, b) in totals.items()), key=lambda row: -row[3])


def _rank_lines(report: DryRun, run: RankRun, gpu: str) -> list[str]:
    coords = ", ".join(f"{axis} {value}" for axis, value in run.coords.items())
    t = run.seconds
    lines = [f"rank {run.role.rank} ({coords}): {run.role.name}; groups {t['groups']:.2f} s, build {t['build']:.1f} s, "
             f"step {t['step']:.1f} s", *_memory_lines(report, run), "  communication in the step:"]
    lines += [f"    {group:<36}{name:<24}{count:>6} calls {nbytes / 2**20:>12.1f} MiB"
              for group, name, count, nbytes in communication(run)]
    verdict = "fits" if fits(run, gpu) else "does not fit"
    lines.append(f"  {verdict}: {needed(run):.1f} GiB with {RESERVED_GIB:.1f} reserved, "
                 f"{GPUS[gpu][0] / 1024:.1f} GiB per {gpu}")
    return lines


def format_dry_run(report: DryRun, gpu: str = "h100") -> str:
    p, t = report.cfg.parallel, report.seconds
    short = "" if report.microbatches == report.full_microbatches else (
        f" (of {report.full_microbatches}: the shortest step with the same peak)")
    lines = [f"dry run: world {report.world_size} = tp {p.tp} x cp {p.cp} x pp {p.pp} (vp {p.vp}) x dp "
             f"{report.cfg.data_parallel_size(report.world_size)}, ep {p.ep} x etp {p.etp}; "
             f"{report.microbatches} micro batches per step{short}",
             f"config validated in {t['validation']:.2f} s; one rank's groups built in {t['groups']:.2f} s, "
             f"{report.group_bytes / 2**20:+.1f} MiB resident"]
    if report.pipeline is not None:
        state = "passes" if report.pipeline.ok else "FAILS"
        lines.append(f"whole pipeline ({p.pp} ranks x vp {p.vp}, {report.full_microbatches} micro batches): "
                     f"{report.pipeline.calls} calls, {report.pipeline.messages} messages, {state} NCCL's rules "
                     f"in {t['pipeline']:.1f} s")
        lines += [f"  {problem}" for problem in report.pipeline.problems[:10]]
    for run in report.ranks:
        lines += _rank_lines(report, run, gpu)
    for role, error in report.failures.items():
        lines.append(f"{role}: FAILED\n{error}")
    return "\n".join(lines)


def exit_status(report: DryRun, gpu: str) -> int:
    """0 when every simulated rank ran its step and fits and the pipeline passes; 1 otherwise."""
    return 0 if report.ok and all(fits(run, gpu) for run in report.ranks) else 1
