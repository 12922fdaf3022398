"""The layout search's answers as text: the top layouts with their figures and why the first wins, one layout's
time terms (`--explain`), and for a layout that does not fit the cheapest single changes that would.
"""

from __future__ import annotations

import dataclasses

from megalite.config import Config, ConfigError
from megalite.config_validation import validate
from megalite.planning.cluster import Cluster
from megalite.planning.plan import make_plan
from megalite.planning.search import SearchResult, describe
from megalite.planning.step_time import StepTime, peak_flops, step_time
from megalite.planning.traffic import gradient_buffers
from megalite.training.flops import training_flops_per_token

TERMS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "edp")


def model_mfu(cfg: Config, world_size: int, time: StepTime, gpu: str) -> float:
    """The MFU the predicted step gives (model FLOPs over the step time at the GPUs' peak)."""
    tokens = cfg.batch_size(world_size) * cfg.model.seq_length
    return training_flops_per_token(cfg.model) * tokens / (time.seconds * world_size * peak_flops(cfg, gpu))


def _row(index: int, layout: str, cfg: Config, time: StepTime, gib: float, cluster: Cluster) -> str:
    terms = time.terms()
    tokens = cfg.batch_size(cluster.world_size) * cfg.model.seq_length / time.seconds / cluster.world_size
    cells = " ".join(f"{terms.get(t, 0.0):7.2f}" for t in TERMS)
    mfu = model_mfu(cfg, cluster.world_size, time, cluster.gpu)
    return f"{index:>2}. {time.seconds:7.2f} s {tokens:8,.0f} {mfu:5.1%} {gib:5.1f}  {cells}  {layout}"


def format_search(result: SearchResult, cluster: Cluster, mfu: float) -> str:
    lines = [f"cluster: {cluster.describe()}",
             f"time model: compute at {mfu:.0%} of the dense peak (hardware FLOPs), the schedule's bubble, each axis's "
             "communication on its link, hidden where megalite overlaps it (megalite/planning/step_time.py)",
             f"searched: {result.considered} layouts the validator accepts, {result.pruned} dropped on estimated "
             f"memory, {result.planned} planned exactly"]
    if not result.ranked:
        return "\n".join([*lines, "no layout fits: give more GPUs, a larger GPU or a smaller global batch / sequence"])
    header = "     step       tok/s/GPU  MFU   GiB   " + " ".join(f"{t:>7}" for t in TERMS) + "  layout"
    lines += ["top layouts (seconds per step by cause; GiB: the planner's memory per GPU with its reserve):", header]
    for i, c in enumerate(result.ranked, 1):
        lines.append(_row(i, c.layout, c.cfg, c.time, c.plan.needed_gib, cluster))
    lines += why_first(result)
    return "\n".join(lines)


def why_first(result: SearchResult) -> list[str]:
    """What the first layout saves over each runner-up, by term."""
    if len(result.ranked) < 2:
        return []
    best = result.ranked[0]
    lines = [f"why #1 wins: the fastest that fits ({best.plan.needed_gib:.1f} GiB of "
             f"{best.plan.available_gib:.1f}); against the others, by term (+ means #1 spends more there):"]
    mine = best.time.terms()
    for i, other in enumerate(result.ranked[1:], 2):
        theirs = other.time.terms()
        gaps = {t: mine.get(t, 0.0) - theirs.get(t, 0.0) for t in TERMS}
        ordered = sorted(gaps.items(), key=lambda kv: kv[1])
        shown = ", ".join(f"{t} {gap:+.2f} s" for t, gap in ordered if abs(gap) >= 0.01)
        lines.append(f"  vs #{i}: {best.time.seconds - other.time.seconds:+.2f} s ({shown or 'the same terms'})")
    return lines


def exact_time(cfg: Config, cluster: Cluster, mfu: float) -> StepTime:
    """The step time with each stage's gradient buffers as built (planning/traffic.py gradient_buffers)."""
    world = cluster.world_size
    return step_time(cfg, world, cluster, mfu, [gradient_buffers(cfg, world, r) for r in range(cfg.parallel.pp)])


def format_explain(cfg: Config, cluster: Cluster, mfu: float) -> str:
    """One layout's time terms: compute, bubble, and each axis's traffic, link, transfer time and exposure."""
    time = exact_time(cfg, cluster, mfu)
    lines = [f"cluster: {cluster.describe()}",
             f"layout: {describe(cfg, time.microbatches)}; slowest stage {time.pp_rank}",
             f"  compute      {time.microbatches} micro batches x {time.compute * 1e3:.1f} ms "
             f"(hardware FLOPs at {mfu:.0%} of the peak) = {time.microbatches * time.compute:.2f} s",
             f"  bubble       {time.bubble:.2%} of the micro batches' time ({cfg.parallel.pipeline_schedule} formula) "
             f"= {time.terms()['bubble']:.2f} s"]
    for axis in time.axes:
        link = "network" if axis.network else "NVLink"
        lines.append(f"  {axis.axis:<4} {axis.payload / 2**30:10.2f} GiB per step on {link}: {axis.seconds:.2f} s of "
                     f"transfer, {time.terms()[axis.axis]:.2f} s exposed")
    mfu_now = model_mfu(cfg, cluster.world_size, time, cluster.gpu)
    lines.append(f"  step         {time.seconds:.2f} s; MFU {mfu_now:.1%}")
    return "\n".join(lines)


def _changes(cfg: Config) -> list[tuple[str, Config]]:
    """Single changes that lower memory: recompute, ZeRO stage, micro batch, pp, tp, cp, offload."""
    p, t = cfg.parallel, cfg.train

    def par(**kw) -> Config:
        return dataclasses.replace(cfg, parallel=dataclasses.replace(p, **kw))

    changes = [(f"--train.recompute={r}", dataclasses.replace(cfg, train=dataclasses.replace(t, recompute=r)))
               for r in ("selective", "full") if r != t.recompute]
    changes += [(f"--parallel.zero_stage={z}", par(zero_stage=z)) for z in (1, 2, 3) if z > p.zero]
    if t.micro_batch_size > 1:
        mbs = t.micro_batch_size // 2
        changes.append((f"--train.micro_batch_size={mbs}",
                        dataclasses.replace(cfg, train=dataclasses.replace(t, micro_batch_size=mbs))))
    changes += [(f"--parallel.pp={p.pp * 2}", par(pp=p.pp * 2)), (f"--parallel.tp={p.tp * 2}", par(tp=p.tp * 2)),
                (f"--parallel.cp={p.cp * 2}", par(cp=p.cp * 2))]
    offloaded = dataclasses.replace(cfg.optim, offload="cpu")
    changes.append(("--optim.offload=cpu (host step not timed)", dataclasses.replace(cfg, optim=offloaded)))
    return changes


def format_fixes(cfg: Config, cluster: Cluster, mfu: float, limit: int = 5) -> str:
    """The single changes (of `_changes`) the validator accepts that make `cfg` fit, fastest first."""
    fitting = []
    for flag, changed in _changes(cfg):
        try:
            validate(changed, cluster.world_size)
        except ConfigError:
            continue
        plan = make_plan(changed, cluster.world_size, cluster.gpu, mfu)
        if plan.fits:
            fitting.append((exact_time(changed, cluster, mfu).seconds, flag, plan.needed_gib))
    if not fitting:
        return "no single change makes it fit: try tools/plan.py --search"
    lines = ["cheapest single changes that make it fit (predicted step time, memory per GPU):"]
    lines += [f"  {flag:<32} {seconds:8.2f} s  {gib:5.1f} GiB" for seconds, flag, gib in sorted(fitting)[:limit]]
    return "\n".join(lines)
