"""Dropout under activation recompute: recomputing a layer must draw the same masks as its forward
did, from the default generator and from the tensor-parallel stream alike, and nested forks of
that stream must not repeat its numbers (which would correlate attention and hidden dropout
under sequence parallelism)."""

from __future__ import annotations

import pytest
import torch

from megalite.data.batches import BatchMaker
from megalite.data.loader import micro_batches
from megalite.data.mock import MockDataset
from megalite.parallel.random import RNGTracker
from megalite.parallel.topology import Topology
from megalite.training.build import build_rank_model
from megalite.training.loss_scaler import LossScaler
from megalite.training.optimizer import build_optimizer
from megalite.training.step import train_step

from conftest import tiny_config
from distributed import run_ranks

MODES = ("none", "selective", "full")


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
        a2 = torch.rand(2)
    with tracker.fork("b"):
        b2 = torch.rand(2)
    assert torch.equal(torch.cat((a1, a2)), torch.rand(4, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.cat((b1, b2)), torch.rand(4, generator=torch.Generator().manual_seed(2)))


def _train(family: str, tp: int, sp: bool, recompute: str, topology: Topology) -> tuple[list[float], list[torch.Tensor]]:
    """Three steps with dropout everywhere; this rank's losses and gradients of the last step."""
    cfg = tiny_config(family, model={"hidden_dropout": 0.1, "attention_dropout": 0.1},
                      parallel={"tp": tp, "sequence_parallel": sp}, train={"recompute": recompute, "train_iters": 3})
    torch.manual_seed(cfg.train.seed)
    parts = build_rank_model(cfg, topology)
    optimizer = build_optimizer(parts.reducer.param_groups(cfg.optim.weight_decay), cfg.optim, topology.device)
    data, gbs, losses = MockDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed), 4, []
    for step in range(3):
        batches = list(micro_batches(data, BatchMaker(), step * gbs, (step + 1) * gbs, 2, topology.dp, topology.dp_rank, 0,
                                     topology.device))
        result = train_step(parts.model, optimizer, LossScaler(), parts.reducer, batches, topology, "fp32", 1.0, parts.pipeline)
        losses.append(result.loss)
    return losses, [p.main_grad.clone() for p in parts.model.parameters()]


def _all_modes(rank: int, world_size: int, family: str, sp: bool) -> dict[str, tuple]:
    topology = Topology(rank, world_size, torch.device("cpu"), tp=world_size)
    return {mode: _train(family, world_size, sp, mode, topology) for mode in MODES}


def _assert_same(runs: dict[str, tuple], what: str) -> None:
    losses, grads = runs["none"]
    assert len(set(losses)) == 3, "dropout must change the losses from step to step"
    for mode in MODES[1:]:
        assert runs[mode][0] == losses, f"{what}, recompute={mode}: {runs[mode][0]} vs {losses}"
        for mine, reference in zip(runs[mode][1], grads):
            assert torch.equal(mine, reference), f"{what}, recompute={mode}: gradients differ"


@pytest.mark.parametrize("family, sp", [("gpt2", False), ("gpt2", True), ("llama", True)])
def test_recompute_replays_dropout_at_tp2(family, sp):
    for rank, runs in enumerate(run_ranks(2, _all_modes, family, sp)):
        _assert_same(runs, f"{family} tp=2 sp={sp} rank {rank}")


def test_recompute_replays_dropout_on_one_device():
    topology = Topology.from_environment("cpu")
    try:
        _assert_same({mode: _train("gpt2", 1, False, mode, topology) for mode in MODES}, "one device")
    finally:
        torch.distributed.destroy_process_group()
