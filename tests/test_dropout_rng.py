"""Dropout under activation recompute: recomputing a layer must draw the same masks as its forward
did, from the default generator and from the tensor-parallel stream alike, and nested forks of
that stream must not repeat its numbers (which would correlate attention and hidden dropout
under sequence parallelism)."""

from __future__ import annotations

import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks

from megalite.data.batches import BatchMaker
from megalite.data.loader import micro_batches
from megalite.data.mock import MockDataset
from megalite.parallel.random import RNGTracker, checkpoint_with_rng
from megalite.parallel.topology import Topology, release_process_groups
from megalite.training.build import build_trainer
from megalite.training.step import train_step

MODES = ("none", "selective", "full")
TP_CASES = [(family, sp) for family in ("gpt2", "llama") for sp in (False, True)]


def test_nested_forks_of_one_stream_continue_it():
    tracker = RNGTracker(torch.device("cpu"))
    tracker.add("tp", 7)
    torch.manual_seed(0)
    with tracker.fork("tp"):
        outer = torch.rand(3)
        with tracker.fork("tp"):
            inner = torch.rand(3)
        after = torch.rand(3)
    default = torch.rand(3)
    assert torch.equal(torch.cat((outer, inner, after)), torch.rand(9, generator=torch.Generator().manual_seed(7)))
    torch.manual_seed(0)
    assert torch.equal(default, torch.rand(3))  # the default stream did not move


def test_nested_forks_of_two_streams_each_continue():
    tracker = RNGTracker(torch.device("cpu"))
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        a1 = torch.rand(2)
        with tracker.fork("b"):
            b1 = torch.rand(2)
            with tracker.fork("a"):  # back into the interrupted stream: it continues, not repeats
                a2 = torch.rand(2)
            b2 = torch.rand(2)
        a3 = torch.rand(2)
    with tracker.fork("b"):
        b3 = torch.rand(2)
    assert torch.equal(torch.cat((a1, a2, a3)), torch.rand(6, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.cat((b1, b2, b3)), torch.rand(6, generator=torch.Generator().manual_seed(2)))


def test_recompute_inside_a_fork_replays_the_mask_and_leaves_the_streams():
    """A checkpoint opened inside a fork of the stream (a layer under SP) whose function forks it again
    (the attention core): the recompute must continue the stream where the forward was, not reload it."""
    tracker = RNGTracker(torch.device("cpu"))
    tracker.add("tp", 7)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork("tp"):
            return x * torch.rand_like(x)

    x = torch.ones(5, requires_grad=True)
    with tracker.fork("tp"):
        torch.rand(3)
        y = checkpoint_with_rng(noisy, x, tracker=tracker)
    after_forward = tracker.state_dict()["tp"]
    y.sum().backward()
    assert torch.equal(x.grad, y.detach()), "the recompute drew another mask than the forward"
    assert torch.equal(tracker.state_dict()["tp"], after_forward) and tracker.forks == []


Run = tuple[list[float], list[torch.Tensor]]


def _train(family: str, tp: int, sp: bool, recompute: str, topology: Topology) -> Run:
    """Three steps with dropout everywhere; this rank's losses and the gradients of the last step."""
    cfg = tiny_config(family, model={"hidden_dropout": 0.1, "attention_dropout": 0.1},
                      parallel={"tp": tp, "sequence_parallel": sp}, train={"recompute": recompute, "train_iters": 3})
    torch.manual_seed(cfg.train.seed)
    data, gbs, losses = MockDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed), 4, []
    with build_trainer(cfg, topology) as parts:
        for step in range(3):
            window = (step * gbs, (step + 1) * gbs, 2, topology.dp, topology.dp_rank, 0, topology.device)
            batches = list(micro_batches(data, BatchMaker(), *window))
            result = train_step(parts, batches)
            losses.append(result.loss)
    return losses, [p.main_grad.clone() for p in parts.model.parameters()]


def _differences(runs: dict[str, Run], what: str) -> list[str]:
    """How recompute selective / full differ from none (empty = bit-identical losses and gradients)."""
    losses, grads = runs["none"]
    found = [] if len(set(losses)) == 3 else [f"{what}: losses {losses} do not move, is dropout on?"]
    for mode in MODES[1:]:
        if runs[mode][0] != losses:
            found.append(f"{what}, recompute={mode}: losses {runs[mode][0]} vs {losses}")
        if not all(torch.equal(mine, reference) for mine, reference in zip(runs[mode][1], grads)):
            found.append(f"{what}, recompute={mode}: gradients differ")
    return found


def _tp_cases(rank: int, world_size: int) -> list[str]:
    """Every family with and without SP on this rank, in one spawn (starting processes costs more than training)."""
    topology = cpu_topology(rank, world_size, tp=world_size)
    found = []
    for family, sp in TP_CASES:
        runs = {mode: _train(family, world_size, sp, mode, topology) for mode in MODES}
        found += _differences(runs, f"{family} tp={world_size} sp={sp} rank {rank}")
    return found


def test_recompute_replays_dropout_at_tp2():
    assert run_ranks(2, _tp_cases) == [[], []]


def test_recompute_replays_dropout_on_one_device():
    topology = Topology.from_environment("cpu")
    try:
        runs = {mode: _train("gpt2", 1, False, mode, topology) for mode in MODES}
    finally:
        release_process_groups()
    assert _differences(runs, "one device") == []
