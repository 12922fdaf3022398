"""Muon's optimizer step as the planner sees it: the MuonPlan the ranks of a stage build (parallel/muon_plan.py,
built here from the meta-device model and the gradient buffers' layouts, so owners are the ranks' own), and from
it each rank's transient memory during the step, its Newton-Schulz FLOPs and its exchange bytes.

The memory follows parallel/muon.py `MuonAdamW.step` moment by moment, in fp32 (4 bytes) or the iteration's
precision (`e`: 2 in bf16): the new momentum of the M elements the rank steps lives through the step; the Nesterov
update (4M) until the whole matrices are assembled; the exchange to the owners (what the rank sends, a bf16 copy of
it, what it receives); the shards of the owned units and the units whole (eW each, W their elements; what arrived is
held until the gather returns, and tensor-parallel shards are put together through one unit's blocks); then, unit by
unit, the finished fp32 results, the wholes not yet done, the unit's fp32 result being written and one matrix's
iteration (X, A = X X^T, B = bA + cA^2 and the new X: e(2nm + 2n^2) for n x m, n <= m; a separate matrix's rows are
copied out first; the fp32 copy and the scaled update at the end); then the way back: the results (4W), the owned
units' shards cut out (4W when split), what goes back and what arrives (4M), and the slices put together (4M). The
peak over these moments is the step's transient (planning/memory.py adds it to the fp32 gradient copies); the worst
rank of the stage is planned. Small per-parameter temporaries of the final write are left out:
tests/test_muon_plan_memory.py holds the figure to the dry run's measured peak within 2%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megalite.config import Config
from megalite.parallel.bucket_layout import BucketLayout
from megalite.parallel.muon_plan import MuonPlan, Unit, owned_by_index
from megalite.parallel.placement import DATA_AXES
from megalite.parallel.topology import RankGrid
from megalite.parallel.zero import unit_index
from megalite.planning.built import rank_model


@dataclass(frozen=True)
class MuonStep:
    """One rank's Muon step: its transient peak (bytes), Newton-Schulz FLOPs, and exchange bytes each way."""

    rank: int
    peak: int
    flops: int
    sent: int
    back: int


def stage_plan(cfg: Config, world_size: int, pp_rank: int) -> MuonPlan:
    """The MuonPlan the ranks of pipeline stage `pp_rank` build (they all derive the same one)."""
    p = cfg.parallel
    model = rank_model(cfg, pp_rank)
    placements = model.placements_by_name()
    names = {id(param): name for name, param in model.named_parameters()}
    grids = {"dense": RankGrid.for_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp),
             "expert": RankGrid.experts_for_world(world_size, etp=p.etp, ep=p.ep, pp=p.pp)}
    units = unit_index(model.chunk_modules()) if p.zero >= 3 else None
    layouts = []
    for params in model.chunk_parameters():
        for grid in dict.fromkeys(placements[names[id(param)]].grid for param in params):
            mine = [param for param in params if placements[names[id(param)]].grid == grid]
            replicas = math.prod(grids[grid].size(axis) for axis in DATA_AXES[grid])
            layouts.append((grid, BucketLayout(list(reversed(mine)), p.bucket_size, replicas, units), p.zero >= 1))
    matrices = model.hidden_matrices(cfg.optim.muon_routers)
    rank = next(r for r in range(world_size) if grids["dense"].coords(r)["pp"] == pp_rank)
    return MuonPlan([(n, param, placements[n]) for n, param in model.named_parameters() if n in matrices], grids,
                    rank, owned_by_index(layouts, names), p.zero >= 1)


def _matrices(unit: Unit, per_head: bool) -> list[tuple[int, int, bool]]:
    """(rows, cols, copied out) of each separate matrix the owner orthogonalises in `unit`."""
    rows, cols = unit.shape
    separate = unit.separate_rows(per_head)
    return [(rows, cols, False)] if separate is None else [(len(r), cols, True) for r in separate]


def _iteration_bytes(rows: int, cols: int, copied: bool, e: int) -> int:
    """The most bytes one matrix's orthogonalisation holds at once (parallel/muon.py newton_schulz)."""
    n, m = min(rows, cols), max(rows, cols)
    end = e * n * m + (4 * n * m if e != 4 else 0) + 4 * n * m
    return e * n * m * copied + max(e * (2 * n * m + 2 * n * n), end)


def iteration_flops(rows: int, cols: int, steps: int) -> int:
    """One matrix's Newton-Schulz FLOPs: per iteration X X^T (2n^2 m), A A (2n^3) and B X (2n^2 m)."""
    n, m = min(rows, cols), max(rows, cols)
    return steps * (4 * n * n * m + 2 * n ** 3)


def _exchanged(plan: MuonPlan) -> dict[str, dict[int, int]]:
    """Elements by rank, in one pass over the pieces: what it steps, sends to owners, receives as an owner, and
    returns to the holders as an owner."""
    counts: dict[str, dict[int, int]] = {key: {} for key in ("stepped", "sent", "received", "back")}
    for unit in plan.units:
        for piece in unit.pieces:
            n = piece.hi - piece.lo
            for key, rank, counted in (("stepped", piece.rank, True), ("sent", piece.rank, piece.sends),
                                       ("received", unit.owner, piece.sends), ("back", unit.owner, True)):
                counts[key][rank] = counts[key].get(rank, 0) + n * counted
    return counts


def rank_step(cfg: Config, plan: MuonPlan, rank: int, counts: dict[str, dict[int, int]]) -> MuonStep:
    """Rank `rank`'s Muon step under `plan` (`counts`: `_exchanged`; see the module docstring for the moments)."""
    e = 4 if cfg.train.precision == "fp32" else 2
    per_head, steps = cfg.optim.muon_split_heads, cfg.optim.muon_ns_steps
    stepped, sent, received, back = (counts[key].get(rank, 0) for key in ("stepped", "sent", "received", "back"))
    owned = [unit for unit in plan.units if unit.owner == rank]
    whole = [math.prod(unit.shape) for unit in owned]
    total = sum(whole)
    exchange = e * sent * (1 + (e != 4)) + e * received
    blocks = max((math.prod(unit.shape) for unit in owned if unit.gathered), default=-total)  # unshard's blocks
    gather = 4 * stepped + max(exchange, e * received + e * total + e * (total + blocks))
    done, orthogonalise = 0, 0
    for unit, n in zip(owned, whole):
        iteration = max(_iteration_bytes(*shape, e) for shape in _matrices(unit, per_head))
        orthogonalise = max(orthogonalise, 4 * done + e * (total - done) + 4 * n + iteration)
        done += n
    cut = 4 * sum(n for unit, n in zip(owned, whole) if unit.gathered)
    scatter = 4 * total + max(cut + 4 * back + 4 * stepped, cut + 8 * stepped)
    flops = sum(iteration_flops(r, c, steps) for unit in owned for r, c, _ in _matrices(unit, per_head))
    return MuonStep(rank, 4 * stepped + max(gather, orthogonalise, scatter), flops, e * sent, 4 * back)


def stage_steps(cfg: Config, world_size: int, pp_rank: int) -> list[MuonStep]:
    """Every rank of stage `pp_rank`'s Muon step; none without Muon."""
    if cfg.optim.optimizer != "muon":
        return []
    plan = stage_plan(cfg, world_size, pp_rank)
    counts = _exchanged(plan)
    return [rank_step(cfg, plan, rank, counts) for rank in sorted(counts["stepped"])]
