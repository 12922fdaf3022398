"""The dry run (megalite/dryrun/, tools/dry_run.py): real ranks of full-size layouts on fake tensors.

First its measuring: live bytes follow storages (views, frees, resizes, saved tensors) exactly, and a simulated
rank of a tiny layout holds what real gloo ranks of the same layout hold. Then every example in examples/ runs a
step at the world size it is written for, fits its GPU, passes NCCL's rules along the whole pipeline, and
matches the planner within 5% on every simulated rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_examples import PLAN_LINE, PLANNED
from torch._C._distributed_c10d import FakeProcessGroup

from megalite.config_cli import apply_mapping, parse_config
from megalite.dryrun.fake_world import fake_rank, fake_tensors
from megalite.dryrun.live_bytes import LiveBytes
from megalite.dryrun.rank_step import simulate_rank
from megalite.dryrun.report import TOLERANCE, difference, exit_status, fits, format_dry_run
from megalite.dryrun.roles import Role, roles
from megalite.dryrun.run import dry_run
from megalite.parallel.mappings import all_gather_single, reduce_scatter_single
from megalite.parallel.storage import resize_storage
from megalite.planning.measure import MEASUREMENT, measurement_config, rank_memory

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _counted(how: str) -> Iterator[LiveBytes]:
    """Fake tensors whose storages a LiveBytes counts: as a mode of its own above the fake mode, or from inside
    the fake mode (how the dry run counts, one dispatch per call)."""
    live = LiveBytes()
    with contextlib.ExitStack() as stack:
        for context in (fake_tensors(), live.counting()) if how == "own mode" else (fake_tensors(live),):
            stack.enter_context(context)
        yield live


COUNTINGS = ["own mode", "inside the fake mode"]


@pytest.mark.parametrize("how", COUNTINGS)
def test_live_bytes_follow_storages_until_they_die_or_shrink(how):
    with _counted(how) as live:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:20]
        with live.making("weights"):
            b = torch.empty(500, dtype=torch.bfloat16)  # 1000 bytes
        assert live.live == 5000 and live.totals["weights"] == 1000 and live.totals["transient"] == 4000
        del a
        assert live.live == 5000  # the view keeps the storage alive
        resize_storage(view, 0)  # how megalite frees storage (parallel/storage.py)
        assert live.live == 1000 and live.peak == 5000
        resize_storage(view, 400)
        assert live.live == 1400
        del view, b
        assert live.live == 0 and live.at_peak == {"transient": 4000, "weights": 1000}


@pytest.mark.parametrize("how", COUNTINGS)
def test_what_autograd_saves_counts_as_activations(how):
    with _counted(how) as live:
        w = torch.empty(64, 64, requires_grad=True)
        live.label([w], "weights")
        x = torch.empty(8, 64)
        hidden = torch.tanh(x @ w)  # tanh saves its output; the matmul saves x (w is a weight already)
        assert live.totals["activations"] == 2 * 8 * 64 * 4 and live.totals["weights"] == 64 * 64 * 4
        del hidden, x


TINY = {"model": {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 32, "vocab_size": 256},
        "parallel": {"tp": 2, "pp": 2, "sequence_parallel": True, "distributed_optimizer": True},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "precision": "bf16", "param_dtype": "bf16"}}


def test_a_simulated_rank_holds_the_model_state_real_ranks_hold():
    """The same tiny layout on 8 gloo ranks (tp2 x pp2 x dp2) and simulated: parameters, gradient buffers, main
    weights and Adam's state after a step are the same bytes on every stage."""
    cfg = measurement_config(8, **TINY)
    real = run_ranks(8, rank_memory, cfg)
    for role in roles(cfg, 8):
        run = simulate_rank(cfg, 8, role, cfg.num_microbatches(8))
        held = real[role.rank]
        assert (run.memory["weights"], run.memory["gradients"], run.memory["main_weights"],
                run.memory["optimizer"]) == (held["params"], held["grads"], held["main"], held["state"]), role


# (collective, output shape, input shape, output splits, input splits) on 8 ranks: tensors that fit and that do not
COLLECTIVES = [("all_gather", (16, 4), (2, 4)), ("all_gather", (16, 4), (1, 4)), ("all_gather", (16, 4), (3, 4)),
               ("all_gather", (15, 4), (2, 4)), ("all_gather", (64, 2), (8,)),
               ("reduce_scatter", (2, 4), (16, 4)), ("reduce_scatter", (2, 4), (15, 4)),
               ("reduce_scatter", (3, 4), (16, 4)), ("reduce_scatter", (8, 1), (64,)),
               ("all_to_all", (16, 4), (16, 4), [], []), ("all_to_all", (16, 4), (12, 4), [], []),
               ("all_to_all", (10, 4), (12, 4), [1] * 7 + [3], [2] * 6 + [0, 0]),
               ("all_to_all", (10, 4), (12, 4), [1] * 7 + [2], [2] * 6 + [0, 0]),
               ("all_to_all", (10, 4), (0, 4), [1] * 7 + [3], [0] * 8),
               ("all_to_all", (10, 4), (12, 5), [1] * 7 + [3], [2] * 6 + [0, 0]),
               ("all_to_all", (0, 4), (12, 5), [0] * 8, [2] * 6 + [0, 0])]


# How the dry run's group is called (megalite's and torch.distributed's functions), and torch's fake group's
# method for each
POSTS = {"all_gather": (lambda out, given, _: all_gather_single(out, given, dist.group.WORLD),
                        "_allgather_base"),
         "reduce_scatter": (lambda out, given, _: reduce_scatter_single(out, given, dist.group.WORLD),
                            "_reduce_scatter_base"),
         "all_to_all": (lambda out, given, splits: dist.all_to_all_single(out, given, *splits), "alltoall_base")}


def _refused(post: Callable[..., object], *args: object) -> bool:
    try:
        post(*args)
    except (RuntimeError, IndexError, ValueError):
        return True
    return False


def test_the_fake_worlds_collectives_refuse_what_torchs_fake_group_refuses():
    """The dry run's groups skip the copies torch's fake group makes to fill a collective's output from its input
    (there is nothing to fill in a fake tensor); tensors that would not fit those copies, or torch's split rules,
    are refused all the same."""
    for rank in (0, 3, 7):
        torch_group = FakeProcessGroup._create_internal(rank, 8)
        with fake_rank(rank, 8), fake_tensors():
            for name, out_shape, in_shape, *splits in COLLECTIVES:
                ours, theirs = POSTS[name]
                out, given = torch.empty(out_shape), torch.empty(in_shape)
                refused = _refused(ours, out, given, splits)
                assert refused == _refused(getattr(torch_group, theirs), out, given, *splits), (rank, name, splits,
                                                                                                 out_shape, in_shape)


def _example(path: Path) -> tuple[int, str]:
    _, world, gpu, _ = PLAN_LINE.search(path.read_text()).groups()
    return int(world), gpu


@pytest.mark.parametrize("path", PLANNED, ids=lambda p: p.stem)
def test_every_example_dry_runs_at_its_world_size(path):
    """One step of each role's rank at the example's real world size (the shortest step with the same memory
    peak), every call of the pipeline under NCCL's rules; fits its GPU and agrees with the planner."""
    world, gpu = _example(path)
    cfg = parse_config(["--config", str(path)])
    apply_mapping(cfg, MEASUREMENT, "dry run")
    report = dry_run(cfg, world, "peak")
    text = format_dry_run(report, gpu)
    assert report.ok, text
    for run in report.ranks:
        assert fits(run, gpu), text
        assert abs(difference(run, report.plan(run))) <= TOLERANCE, text


def test_the_tool_prints_each_rank_and_exits_with_the_verdict():
    command = [sys.executable, str(ROOT / "tools" / "dry_run.py"), "--config", str(ROOT / "examples/gpt2_125m.yaml"),
               "--world-size", "8", "--microbatches", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^  fits: [\d.]+ GiB", done.stdout, re.M) and "data-parallel" in done.stdout
    small = subprocess.run([*command, "--gpu", "a10g", "--train.micro_batch_size=64"], capture_output=True,
                           text=True, timeout=600)
    assert small.returncode == 1 and "does not fit" in small.stdout
    bad = subprocess.run([*command, "--parallel.tp=3"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "parallel.tp" in bad.stderr


def test_a_capacity_without_padding_is_refused_with_the_fix():
    cfg = measurement_config(4, model={**TINY["model"], "num_experts": 4, "moe_capacity_factor": 1.0},
                             parallel={"ep": 2})
    with pytest.raises(ValueError, match="moe_pad_to_capacity"):
        dry_run(cfg, 4, 1)


def test_a_rank_that_crashes_is_reported_and_fails_the_run(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a layer that cannot run")

    monkeypatch.setattr("megalite.dryrun.run.simulate_rank", broken)
    cfg = measurement_config(2, model=TINY["model"])
    report = dry_run(cfg, 2, 1)
    assert not report.ok and exit_status(report, "h100") == 1
    assert "a layer that cannot run" in format_dry_run(report)


def test_roles_are_the_first_middle_and_last_stage():
    cfg = measurement_config(16, **{**TINY, "parallel": {"tp": 2, "pp": 4}, "train": {"global_batch_size": 8}})
    assert roles(cfg, 16) == [Role(0, 0, "first stage 0: embedding, the planner's largest"),
                              Role(8, 2, "middle stage 2: layers only"), Role(12, 3, "last stage 3: head and loss")]


def test_a_zero_bubble_layout_dry_runs():
    """ZB-V puts the embedding and the head on the first stage; every rank's step runs, and the whole pipeline,
    W operations included, passes NCCL's rules."""
    cfg = measurement_config(8, **{**TINY, "parallel": {**TINY["parallel"], "vp": 2, "pipeline_schedule": "zb-v"}})
    report = dry_run(cfg, 8, 3)
    assert report.ok, format_dry_run(report, "h100")
    first, last = (role.name for role in roles(cfg, 8))
    assert first.startswith("first stage 0: embedding and head and loss") and last.startswith("last stage 1: layers")


def test_a_step_leaves_no_tensors_to_the_cyclic_collector():
    """Every rank's step of the 405B example's layout kinds (interleaved pp, tp with sequence parallelism, cp, the
    distributed optimizer, selective recompute) frees its tensors by reference counting: none is left in a
    reference cycle that only Python's cyclic collector would free (on a GPU, memory held until a collection;
    here, a dry run whose figures depend on when one runs)."""
    cfg = measurement_config(16, **{**TINY, "model": {**TINY["model"], "num_layers": 8},
                                    "parallel": {**TINY["parallel"], "vp": 2, "cp": 2},
                                    "train": {**TINY["train"], "recompute": "selective"}})
    gc.collect()
    gc.disable()
    try:
        for role in roles(cfg, 16):
            simulate_rank(cfg, 16, role, cfg.num_microbatches(16))
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        in_cycles = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert in_cycles == []


def test_ranks_simulated_side_by_side_report_what_one_process_does():
    """The simulated ranks and the pipeline replay run in processes of their own (one per core): every number of
    the report is the one a single process gets, each rank's recorded calls included."""
    cfg = measurement_config(8, **TINY)
    alone, side_by_side = dry_run(cfg, 8, 2, workers=1), dry_run(cfg, 8, 2, workers=2)
    assert side_by_side.ok and len(side_by_side.ranks) == 2
    for one, other in zip(alone.ranks, side_by_side.ranks, strict=True):
        assert (one.role, one.coords, one.memory, one.host, one.build) == (other.role, other.coords, other.memory,
                                                                          other.host, other.build)
        assert [dataclasses.astuple(c) for c in one.calls] == [dataclasses.astuple(c) for c in other.calls]
    assert dataclasses.astuple(alone.pipeline) == dataclasses.astuple(side_by_side.pipeline)
