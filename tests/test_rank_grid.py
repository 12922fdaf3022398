"""The rank grids: where each rank sits and which ranks form each group, in Megatron-LM's order: the dense
grid (tp fastest, then cp, dp, pp) and, over the same ranks, the expert grid (etp, ep, edp, pp).

Placement is pinned as literal data: checkpoints record which rank held which shard, so moving a rank
would silently change what a saved checkpoint means. The group lists are pure grid arithmetic; one
spawned test checks that Topology's process groups hold exactly those ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from megatron_rank_groups import LAYOUTS

from megalite.parallel.topology import DENSE_AXES, EXPERT_AXES, RankGrid, Topology

# (tp, pp, dp) -> each rank's (pp, dp, tp) coordinates, as every layout so far placed them
PLACEMENT = {
    (2, 2, 2): [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)],
    (1, 4, 1): [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)],
    (1, 1, 4): [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0)],
    (2, 3, 1): [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1)],
    (4, 1, 3): [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3),
                (0, 2, 0), (0, 2, 1), (0, 2, 2), (0, 2, 3)],
    (2, 2, 3): [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0),
                (1, 1, 1), (1, 2, 0), (1, 2, 1)],
}


@pytest.mark.parametrize("tp, pp, dp", list(PLACEMENT))
def test_placement_is_tp_fastest_then_dp_then_pp(tp, pp, dp):
    grid = RankGrid.for_world(tp * pp * dp, tp=tp, pp=pp)
    assert grid.dp == dp and grid.world_size == tp * pp * dp
    coords = [grid.coords(rank) for rank in range(grid.world_size)]
    assert [(c["pp"], c["dp"], c["tp"]) for c in coords] == PLACEMENT[(tp, pp, dp)]
    assert all(c["cp"] == 0 for c in coords)
    assert [grid.rank(c) for c in coords] == list(range(grid.world_size))


def test_groups_are_megatrons_for_16_ranks_tp2_pp4():
    """The example of Megatron-LM's initialize_model_parallel docstring (megatron/core/parallel_state.py)."""
    grid = RankGrid.for_world(16, tp=2, pp=4)
    assert grid.groups(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.groups(("dp",)) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert grid.groups(("pp",)) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups(("tp", "pp")) == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_context_parallel_sits_between_tp_and_dp():
    grid = RankGrid.dense(tp=2, cp=2, dp=2)
    assert grid.groups(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups(("cp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups(("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups(("tp", "cp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.groups(("cp", "dp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_parallel_sits_between_etp_and_edp():
    """Issue 25 moved ep out of the dense grid (where it multiplied the world) into the expert grid."""
    grid = RankGrid.expert(ep=2, edp=2, pp=2)
    assert grid.groups(("ep",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups(("edp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups(("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("axes_of_grid, grid", [(DENSE_AXES, RankGrid.dense(2, 2, 2, 2)),
                                                (EXPERT_AXES, RankGrid.expert(2, 2, 2, 2))])
def test_all_axes(axes_of_grid, grid):
    assert grid.coords(0b1110) == dict(zip(axes_of_grid, (0, 1, 1, 1)))
    for axes in [(axis,) for axis in axes_of_grid] + [axes_of_grid[::3], axes_of_grid]:
        groups = grid.groups(axes)
        assert sorted(rank for ranks in groups for rank in ranks) == list(range(16)), axes
        for ranks in groups:
            assert len(ranks) == 2 ** len(axes) and ranks == sorted(ranks)
            assert [grid.index_in(rank, axes) for rank in ranks] == list(range(len(ranks)))
            fixed = {axis: grid.coords(ranks[0])[axis] for axis in axes_of_grid if axis not in axes}
            assert all({axis: grid.coords(rank)[axis] for axis in fixed} == fixed for rank in ranks), (axes, ranks)


def test_bad_sizes_and_axes_say_what_is_wrong():
    with pytest.raises(ValueError, match="not a multiple of tp"):
        RankGrid.for_world(6, tp=4)
    with pytest.raises(ValueError, match="not a multiple of etp . ep . pp"):
        RankGrid.experts_for_world(12, ep=8)
    with pytest.raises(ValueError, match="unknown rank-grid axes"):
        RankGrid.dense(tp=2).groups(("sp",))
    with pytest.raises(ValueError, match="outside the grid"):
        RankGrid.dense(tp=2).coords(2)


def _topology_groups(rank: int, world_size: int) -> dict:
    t = Topology(rank, world_size, torch.device("cpu"), tp=2, pp=2)
    groups = {name: dist.get_process_group_ranks(group) for name, group in t.named_groups().items()}
    return {"coords": (t.pp_rank, t.dp_rank, t.tp_rank), "dp": t.dp, "groups": groups}


def test_topology_groups_hold_the_grid_groups():
    results = run_ranks(8, _topology_groups)
    grid = RankGrid.for_world(8, tp=2, pp=2)

    def mine(groups: list[list[int]], rank: int) -> list[int]:
        return next(ranks for ranks in groups if rank in ranks)

    for rank, result in enumerate(results):
        assert result["coords"] == PLACEMENT[(2, 2, 2)][rank] and result["dp"] == 2
        assert result["groups"] == {
            "tensor-parallel": mine(grid.groups(("tp",)), rank),
            "data-parallel": mine(grid.groups(("dp",)), rank),
            "pipeline-parallel": mine(grid.groups(("pp",)), rank),
            "embedding": mine(grid.groups(("pp",)), rank),  # pp = 2: first and last stage are the whole pipeline
        }


def _cp_topology(rank: int, world_size: int) -> dict:
    t = Topology(rank, world_size, torch.device("cpu"), tp=2, cp=2)
    groups = {name: dist.get_process_group_ranks(group) for name, group in t.named_groups().items()}
    return {"ranks": (t.tp_rank, t.cp_rank, t.dp_rank, t.dp_cp_rank), "sizes": (t.dp, t.dp_cp), "groups": groups}


def test_topology_with_context_parallelism():
    """tp2 x cp2 x dp2: cp ranks hold the same weights, so gradients and optimizer shards span the
    data-and-context-parallel group, in which rank (dp, cp) sits at dp * cp + cp."""
    grid = RankGrid.for_world(8, tp=2, cp=2)
    for rank, result in enumerate(run_ranks(8, _cp_topology)):
        tp, cp, dp = rank % 2, rank // 2 % 2, rank // 4
        assert result["ranks"] == (tp, cp, dp, dp * 2 + cp) and result["sizes"] == (2, 4)
        mine = {name: next(r for r in grid.groups(axes) if rank in r) for name, axes in (
            ("context-parallel", ("cp",)), ("data-and-context-parallel", ("cp", "dp")), ("data-parallel", ("dp",)))}
        assert {name: result["groups"][name] for name in mine} == mine
        assert result["groups"]["data-and-context-parallel"].index(rank) == dp * 2 + cp


DENSE_TOKENS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp-cp": ("cp", "dp"), "pp": ("pp",),
                "tp-pp": ("tp", "pp"), "tp-cp": ("tp", "cp"), "tp-dp-cp": ("tp", "cp", "dp")}
EXPERT_TOKENS = {"tp": ("etp",), "ep": ("ep",), "dp": ("edp",), "tp-ep": ("etp", "ep"),
                 "tp-ep-pp": ("etp", "ep", "pp"), "pp": ("pp",)}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_both_grids_give_megatron_cores_groups(name):
    """Every group of Megatron-Core's RankGenerator, dense and expert (parallel folding, ep > dp in layouts C
    and F), pinned as data in tests/megatron_rank_groups.py: the same ranks in the same order."""
    layout = LAYOUTS[name]
    s = layout["sizes"]
    dense = RankGrid.for_world(s["world"], tp=s["tp"], pp=s["pp"], cp=s["cp"])
    expert = RankGrid.experts_for_world(s["world"], etp=s["etp"], ep=s["ep"], pp=s["pp"])
    assert {token: dense.groups(axes) for token, axes in DENSE_TOKENS.items()} == layout["dense"]
    assert {token: expert.groups(axes) for token, axes in EXPERT_TOKENS.items()} == layout["expert"]


def _expert_topology(rank: int, world_size: int) -> dict:
    t = Topology(rank, world_size, torch.device("cpu"), tp=2, pp=2, ep=8)
    groups = {name: dist.get_process_group_ranks(group) for name, group in t.named_groups().items()}
    return {"groups": groups, "edp": t.coord("edp", grid="expert"), "ep": t.coord("ep", grid="expert")}


def test_topology_makes_the_expert_groups_over_the_same_ranks():
    """Layout F (tp2 x pp2 x dp4 dense, ep8 expert): the expert groups join the dense ones, which are
    unchanged; the expert-parallel group spans a whole pipeline stage, wider than the dense dp."""
    layout = LAYOUTS["F"]
    for rank, result in enumerate(run_ranks(16, _expert_topology)):
        mine = {name: next(ranks for ranks in layout[grid][token] if rank in ranks) for name, grid, token in (
            ("tensor-parallel", "dense", "tp"), ("data-parallel", "dense", "dp"), ("pipeline-parallel", "dense", "pp"),
            ("expert-tensor-parallel", "expert", "tp"),
            ("expert-parallel", "expert", "ep"), ("expert-data-parallel", "expert", "dp"),
            ("expert-tensor-and-expert-parallel", "expert", "tp-ep"))}
        assert {name: result["groups"][name] for name in mine} == mine
        assert result["ep"] == rank % 8 and result["edp"] == 0
