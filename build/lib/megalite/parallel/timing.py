"""Marks on the device's timeline, for timings that mean the same on a CPU and a GPU.

On a GPU the host only enqueues work: `work.wait()` on NCCL makes the current stream wait and
returns at once, and a forward returns long before its kernels ran, so a host clock around either
measures enqueueing. A device mark is a CUDA event recorded on the current stream: the interval
between two marks is the time the GPU spent there, a wait for a collective included. On the CPU a
mark is the host clock, which there is the same thing. Intervals are read once the work is done
(`seconds` waits for the later mark), so readers do it at log steps or at the end.
"""

from __future__ import annotations

import time
from typing import Union

import torch

Mark = Union[float, "torch.cuda.Event"]


def mark(device: torch.device) -> Mark:
    """Now, on `device`'s timeline."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds(start: Mark, end: Mark) -> float:
    """Seconds from `start` to `end` (marks of one device); waits until the device has passed `end`."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1000.0
