"""Observed process groups (megalite/parallel/observed.py): the seam through which the NCCL-rule recorder and
the benchmarks' meters see communication, instead of replacing torch.distributed's functions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from megalite.dryrun.nccl_rules.record import CommRecorder
from megalite.parallel.observed import CommObserver, GroupCall, observing


class _Log(CommObserver):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def posting(self, call: GroupCall) -> None:
        self.events.append(("posting", call.operation, call.group.group_desc, len(call.tensors())))

    def posted(self, call: GroupCall) -> None:
        self.events.append(("posted", call.operation))

    def waiting(self, call: GroupCall) -> None:
        self.events.append(("waiting", call.operation))

    def waited(self, call: GroupCall) -> None:
        self.events.append(("waited", call.operation))


def _observe(rank: int, world_size: int) -> tuple[list[tuple], list[float], list[float]]:
    """A collective on a subgroup and a batched exchange observed; one more collective after the block."""
    out, inbox = torch.full((2,), float(rank)), torch.empty(2)
    pair = dist.new_group([0, 1], group_desc="pair")
    with observing(_Log()) as log:
        dist.all_reduce(out, group=pair)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, 1 - rank, pair),
                                         dist.P2POp(dist.irecv, inbox, 1 - rank, pair)])
        for work in works:
            work.wait()
    dist.all_reduce(out)
    return log.events, inbox.tolist(), out.tolist()


def test_an_observer_is_told_each_operation_and_wait_inside_its_block_and_the_data_still_travels():
    for events, inbox, out in run_ranks(2, _observe, observed_groups=True):
        assert events == [("posting", "allreduce", "pair", 1), ("posted", "allreduce"), ("waiting", "allreduce"),
                          ("waited", "allreduce"),
                          ("posting", "send", "pair", 1), ("posted", "send"), ("posting", "recv", "pair", 1),
                          ("posted", "recv"), ("waiting", "send"), ("waited", "send"), ("waiting", "recv"),
                          ("waited", "recv")]
        assert inbox == [1.0, 1.0] and out == [2.0, 2.0]


def test_the_recorder_refuses_a_group_it_cannot_observe_and_names_the_backend_to_use():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="'gloo'.*megalite.parallel.observed.GLOO"), CommRecorder(0):
            pass
    finally:
        dist.destroy_process_group()
