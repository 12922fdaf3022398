"""DualPipeV (parallel/pipeline/dualpipe.py) and the pair runner its F&B operations run through (overlap.py).

- Each rank's list runs every forward and backward of both chunks once, each after what it needs on the rank,
  a W for exactly the backwards that leave one, after them; every pair is the forward of one chunk with the
  backward of the other; at most 2 pp + 1 chunk forwards in flight (ZB-V's 2 pp and a pair's forward).
- Played out with free messages (planning/bubble.py, F&B = F + B as on ranks that hide nothing) the lists idle
  exactly the formula (pp-1)(F&B + B - 3W) per chunk where B = F >= W, at most it where F <= B and W <= F, and
  twice ZB-V at equal times; the cost model's F&B term moves both the formula and the lists.
- The validator asks for 2 pp micro batches, naming the fields to change.
- The interleaved pair runner, with a recorded fake of the streams and collectives: the forward part runs first;
  each part hands the turn over right after posting an all-to-all and waits for it only when its turn comes
  back, so the other part's work falls between the post and the wait; the second thread runs on the first's
  stream; a recompute (a forward inside the backward) keeps the turn; an error in either part reaches the caller.
- Parity with one device, NCCL's rules, checkpoints and the trace: tests/test_zero_bubble.py,
  tests/test_nccl_rules.py; compiled layers: tests/test_compile.py.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import pytest
import torch
from conftest import tiny_config

from megalite.config import ConfigError
from megalite.config_validation import validate
from megalite.dryrun.pipeline_plan import check_pipeline
from megalite.parallel.pipeline.ops import B, F, Paired, W
from megalite.parallel.pipeline.overlap import Interleaved, travel
from megalite.parallel.pipeline.registry import bubble_fraction, schedule_ops
from megalite.planning.bubble import simulated_bubble


@pytest.mark.parametrize("pp, m", [(pp, m) for pp in (2, 4, 8) for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 3)])
def test_every_operation_once_in_order_within_zb_v_memory_and_one(pp, m):
    for rank in range(pp):
        ops = schedule_ops("dualpipev", pp, 2, rank, m)
        parts = [part for op in ops for part in op.parts]
        deferred = {(c, mb) for kind, c, mb in parts if kind == W}
        assert Counter((kind, c, mb) for kind, c, mb in parts if kind != W) == Counter(
            (kind, c, i) for kind in (F, B) for c in (0, 1) for i in range(m)), rank
        seen, in_flight, peak = set(), 0, 0
        for kind, chunk, mb in parts:
            before = {F: None, B: F, W: B}[kind]
            assert before is None or (before, chunk, mb) in seen, f"rank {rank}: {kind}{chunk}.{mb} before {before}"
            seen.add((kind, chunk, mb))
            in_flight += (kind == F) - (kind == W or (kind == B and (chunk, mb) not in deferred))
            peak = max(peak, in_flight)
        assert peak <= 2 * pp + 1, (rank, peak)
        pairs = [op for op in ops if isinstance(op, Paired)]
        assert pairs and all(p.forward.kind == F and p.backward.kind == B and p.forward.chunk != p.backward.chunk
                             for p in pairs), rank


TIMES = [(1.0, t_b, t_w) for t_b in (1.0, 1.25, 1.5, 2.0, 3.0) for t_w in (0.25, 0.5, 1.0)] + [(20.0, 31.3, 9.6)]


@pytest.mark.parametrize("times", TIMES)
def test_lists_idle_as_the_formula_says(times):
    t_f, t_b, t_w = times
    for pp in (2, 4, 8):
        for m in (2 * pp, 3 * pp + 1):
            lists = simulated_bubble("dualpipev", pp, 2, m, *times)
            formula = bubble_fraction("dualpipev", pp, 2, m, *times)
            if t_b == t_f >= t_w:
                assert lists == pytest.approx(formula), (pp, m, times)
            assert lists <= formula + 1e-9, (pp, m, times)
            if times == (1.0, 1.0, 1.0):
                assert lists == pytest.approx(2 * simulated_bubble("zb-v", pp, 2, m, *times)), (pp, m)


def test_the_cost_model_s_f_and_b_term():
    """A pair that hides part of its time shortens the lists' step and the formula's idle alike; F&B = F + B is
    the default, and the formula is DeepSeek's (pp-1)(F&B + B - 3W) per chunk over the ideal step."""
    pp, m, (t_f, t_b, t_w) = 4, 8, (1.0, 1.0, 1.0)
    assert bubble_fraction("dualpipev", pp, 2, m) == bubble_fraction("dualpipev", pp, 2, m, t_fb=3.0)
    assert bubble_fraction("dualpipev", pp, 2, m, t_fb=2.4) == pytest.approx(
        (pp - 1) * (2.4 / 2 + (t_b + t_w) / 2 - 3 * t_w / 2) / (m * (t_f + t_b + t_w)))
    faster = [simulated_bubble("dualpipev", pp, 2, m, t_fb=t_fb) for t_fb in (3.0, 2.4)]
    assert faster[1] < faster[0]


def test_the_validator_asks_for_two_micro_batches_per_rank():
    cfg = tiny_config("llama", model={"num_layers": 8, "num_query_groups": 4},
                      parallel={"pp": 4, "vp": 2, "pipeline_schedule": "dualpipev"},
                      train={"micro_batch_size": 1, "global_batch_size": 6})
    with pytest.raises(ConfigError, match="dualpipev needs at least 2 micro batches per pipeline rank: 8 at "
                                          "parallel.pp=4, not 6 .* raise train.global_batch_size"):
        validate(cfg, 4)
    cfg.train.global_batch_size = 8
    validate(cfg, 4)


def test_executor_replays_under_nccl_rules_at_pp16():
    report = check_pipeline("dualpipev", 16, 2, 33)
    assert report.ok, report.text()
    assert report.messages > 0


class _Recorded:
    """Stands in for the accelerator's streams and a collective's work: records, in order, who did what."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def note(self, what: str) -> None:
        self.log.append((threading.current_thread().name, what))

    def current(self) -> str:
        return "compute stream"

    def use(self, stream: str) -> None:
        self.note(f"uses {stream}")

    def work(self, name: str):
        recorded = self

        class Work:
            def wait(self) -> None:
                recorded.note(f"waits for {name}")

        self.note(f"posts {name}")
        return Work()


def _part(recorded: _Recorded, name: str, layers: int):
    """A stand-in for a chunk's pass over MoE layers: compute, then an all-to-all, per layer."""
    def run() -> str:
        for layer in range(layers):
            recorded.note(f"{name} computes {layer}")
            travel(recorded.work(f"{name} all-to-all {layer}"), forward=True)
        return name
    return run


def test_an_all_to_all_travels_while_the_other_part_computes():
    recorded = _Recorded()
    assert Interleaved(recorded).run([_part(recorded, "F", 2), _part(recorded, "B", 3)]) == ["F", "B"]
    steps = [what for _, what in recorded.log]
    assert steps == ["F computes 0", "posts F all-to-all 0",
                     "uses compute stream",  # the backward part's thread, on its first turn
                     "B computes 0", "posts B all-to-all 0",
                     "waits for F all-to-all 0", "F computes 1", "posts F all-to-all 1",
                     "waits for B all-to-all 0", "B computes 1", "posts B all-to-all 1",
                     "waits for F all-to-all 1",  # F is done: B keeps the turn from here
                     "waits for B all-to-all 1", "B computes 2", "posts B all-to-all 2", "waits for B all-to-all 2"]
    threads = {what.split()[0]: thread for thread, what in recorded.log if what[0] in "FB"}
    assert threads["F"] == threading.current_thread().name and threads["B"] != threads["F"]


class _Recomputed(torch.autograd.Function):
    """A layer whose backward reruns a forward with an all-to-all in it, as activation recompute does."""

    @staticmethod
    def forward(ctx, x, recorded):
        ctx.recorded = recorded
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.recorded.note("B recomputes")
        travel(ctx.recorded.work("B's recomputed all-to-all"), forward=True)
        travel(ctx.recorded.work("B's all-to-all"), forward=False)
        return grad, None


def test_a_recompute_keeps_the_turn_and_errors_reach_the_caller():
    recorded = _Recorded()
    x = torch.ones(2, requires_grad=True)
    out = _Recomputed.apply(x, recorded)
    Interleaved(recorded).run([_part(recorded, "F", 2), lambda: out.sum().backward()])
    steps = [what for _, what in recorded.log if not what.startswith("uses")]
    assert steps[:7] == ["F computes 0", "posts F all-to-all 0", "B recomputes", "posts B's recomputed all-to-all",
                         "waits for B's recomputed all-to-all", "posts B's all-to-all", "waits for F all-to-all 0"]

    def failing() -> None:
        raise RuntimeError("a part failed")

    for parts in ([failing, _part(recorded, "B", 1)], [_part(recorded, "F", 1), failing]):
        with pytest.raises(RuntimeError, match="a part failed"):
            Interleaved(recorded).run(parts)
    assert all(thread.name != "pipeline pair: backward" for thread in threading.enumerate())


def test_pairs_in_the_lists_hold_what_they_hide():
    """Both chunks pair up in the steady phase: every rank runs 2(m - 2pp + r + 1) + (pp - r - 1) pairs, the last
    rank one fewer (its first F0 and B1 run apart)."""
    for pp, m in itertools.product((2, 4), (8, 13)):
        for rank in range(pp):
            pairs = sum(isinstance(op, Paired) for op in schedule_ops("dualpipev", pp, 2, rank, m))
            assert pairs == 2 * (m - 2 * pp + rank + 1) + (pp - rank - 1) - (rank == pp - 1), (pp, m, rank)
