"""tools/benchmark_pipeline.py's device clock: an emulated device's timeline beside its host (DeviceClock), on a fake
host clock, so that what it charges is checked without timing anything."""

from __future__ import annotations

import torch
from distributed import cpu_topology, run_ranks

from megalite.parallel.p2p import Message
from tools import benchmark_pipeline as bench


class FakeHost:
    """A host clock that moves only when told to (or when the host sleeps), recording where it slept to."""

    def __init__(self) -> None:
        self.time, self.slept_to = 100.0, []

    def now(self) -> float:
        return self.time

    def sleep(self, moment: float) -> None:
        self.slept_to.append(moment)
        self.time = max(self.time, moment)


def clock_on(host: FakeHost) -> bench.DeviceClock:
    clock = bench.DeviceClock(now=host.now, sleep=host.sleep)
    clock.restart()
    return clock


def test_an_operation_starts_after_the_device_what_it_waited_for_and_its_launch_whichever_is_last():
    host = FakeHost()
    clock = clock_on(host)
    clock.run(5.0)
    assert clock.free == 105.0 and host.slept_to == [100.0]  # the host sleeps until the start, not the end
    host.time = 101.0  # the host went on (posted, reached the next operation) while the device computes
    assert clock.posted() == 105.0  # an exchange posted now follows the compute queued before it
    clock.landed(104.0)  # a message that landed while the device was busy costs nothing
    clock.run(2.0)
    assert clock.free == 107.0
    clock.landed(110.0)  # one that lands later holds what is queued next
    clock.run(2.0)
    assert clock.free == 112.0 and host.slept_to[-1] == 110.0
    clock.run(0.0)  # no time, no operation: the host goes on
    assert clock.free == 112.0 and host.slept_to[-1] == 110.0
    host.time = 120.0  # a host that falls behind its device delays it: its time counts
    assert clock.posted() == 120.0
    clock.run(1.0)
    clock.synchronize()
    assert clock.free == 121.0 and host.slept_to[-1] == 121.0 and host.time == 121.0


def test_a_sleeping_stage_queues_its_forward_backward_and_weight_gradient():
    host = FakeHost()
    clock = clock_on(host)
    x = torch.arange(float(torch.Size(bench.SHAPE).numel())).view(bench.SHAPE).requires_grad_()
    out = bench.Sleep.apply(x, torch.zeros(()), (3.0, 4.0, 2.0), clock)
    assert clock.free == 103.0 and torch.equal(out, x)
    out.backward(torch.ones(bench.SHAPE))
    assert clock.free == 109.0 and torch.equal(x.grad, torch.ones(bench.SHAPE))  # B and, unsplit, W


def test_the_host_clock_has_no_device_timeline():
    clock = bench.HostClock()
    x = torch.zeros(bench.SHAPE, requires_grad=True)
    out = bench.Sleep.apply(x, torch.zeros(()), (0.0, 0.0, 0.0), clock)
    out.backward(torch.ones(bench.SHAPE))
    assert not clock.stamps and torch.equal(out, x) and torch.equal(x.grad, torch.ones(bench.SHAPE))


def _stamped_exchange(rank: int, world_size: int) -> tuple[float, float]:
    """Rank 0 posts an activation while its device is busy until 150, rank 1 receives it with its device busy
    until 120: (the time the message carries, the receiver's device after its wait)."""
    host = FakeHost()
    clock = clock_on(host)
    clock.run(50.0 if rank == 0 else 20.0)
    comm = bench.StampingComm(cpu_topology(rank, world_size, pp=2), bench.SHAPE, torch.float32, clock)
    message = Message("F", 0, 0, 0, 1)
    exchange = comm.exchange([message], {message: torch.zeros(bench.SHAPE)} if rank == 0 else {})
    exchange.wait()
    return bench.stamp_of({**exchange.sent, **exchange.received}[message]), clock.free


def test_a_message_lands_at_its_sender_s_post_and_its_wait_holds_the_receiver_s_device():
    assert run_ranks(2, _stamped_exchange) == [(150.0, 150.0), (150.0, 150.0)]
