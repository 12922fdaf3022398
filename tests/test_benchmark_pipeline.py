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


def test_an_operation_starts_after_the_device_its_input_and_its_launch_whichever_is_last():
    host = FakeHost()
    clock = clock_on(host)
    assert clock.run(5.0) == 105.0 and host.slept_to == [100.0]  # the host sleeps until the start, not the end
    host.time = 101.0  # the host went on (posted, reached the next operation) while the device computes
    assert clock.posted() == 105.0  # an exchange posted now follows the compute queued before it
    assert clock.run(2.0, ready=104.0) == 107.0  # the device was busy longer than its input took to land
    assert clock.run(2.0, ready=110.0) == 112.0  # waits for its input
    assert clock.run(0.0) == 112.0 and host.slept_to[-1] == 110.0  # no time, no operation: the host goes on
    host.time = 120.0  # a host that falls behind its device delays it: its time counts
    assert clock.posted() == 120.0 and clock.run(1.0) == 121.0
    clock.synchronize()
    assert host.slept_to[-1] == 121.0 and host.time == 121.0


def test_messages_carry_their_post_s_device_time_and_outputs_their_end():
    host = FakeHost()
    clock = clock_on(host)
    x = torch.zeros(bench.SHAPE, requires_grad=True)
    assert bench.stamp_of(x) == 0.0  # a first chunk's input lands at once
    hidden = x.detach().clone()
    bench.stamp(hidden, 130.5)  # a message posted at device time 130.5
    hidden.requires_grad_()
    out = bench.Sleep.apply(hidden, torch.zeros(()), (3.0, 4.0, 0.0), clock, False)
    assert bench.stamp_of(out) == 133.5 and clock.free == 133.5
    gradient = torch.zeros(bench.SHAPE)
    bench.stamp(gradient, 140.0)
    out.backward(gradient)
    assert clock.free == 144.0 and bench.stamp_of(hidden.grad) == 144.0  # B ran once its gradient landed


def test_the_loss_s_gradient_is_not_read_as_a_landing_time():
    host = FakeHost()
    clock = clock_on(host)
    x = torch.zeros(bench.SHAPE, requires_grad=True)
    bench.Sleep.apply(x, torch.zeros(()), (1.0, 2.0, 0.0), clock, True).sum().backward()
    assert clock.free == 103.0 and torch.equal(x.grad.view(-1)[2:], torch.ones(x.numel() - 2))


def test_the_host_clock_has_no_device_timeline():
    clock = bench.HostClock()
    x = torch.zeros(bench.SHAPE, requires_grad=True)
    out = bench.Sleep.apply(x, torch.zeros(()), (0.0, 0.0, 0.0), clock, False)
    out.backward(torch.ones(bench.SHAPE))
    assert not clock.stamps and torch.equal(out, x) and torch.equal(x.grad, torch.ones(bench.SHAPE))


def _stamped_exchange(rank: int, world_size: int) -> float:
    """Rank 0 posts an activation while its device is busy until 150; rank 1 returns the time it carries."""
    host = FakeHost()
    clock = clock_on(host)
    clock.run(50.0)
    comm = bench.StampingComm(cpu_topology(rank, world_size, pp=2), bench.SHAPE, torch.float32, clock)
    message = Message("F", 0, 0, 0, 1)
    exchange = comm.exchange([message], {message: torch.zeros(bench.SHAPE)} if rank == 0 else {})
    exchange.wait()
    return bench.stamp_of(exchange.received[message]) if rank == 1 else bench.stamp_of(exchange.sent[message])


def test_a_message_lands_at_the_device_time_of_its_sender_s_post():
    assert run_ranks(2, _stamped_exchange) == [150.0, 150.0]
