"""Where this process sits: rank, device, backend and the process groups it talks over.

The Topology is built once at start-up and handed to whatever needs a group; nothing
here is a module-level global, so a test can build several in one process. This is the
only module that touches CUDA device selection; everything else asks `topology.device`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(preference: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when asked for (or 'auto' and available), else cpu."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but torch sees no CUDA device; use --train.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout_minutes: int = 10) -> None:
    """Join the job torchrun started, or form a one-process group in memory.

    A single process still gets a real process group (over an in-process store), so
    collectives run through the same code path at every world size.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


@dataclass
class Topology:
    """The rank grid of this job. dp = world / (tp * pp); with tp = pp = 1 the data group is the world."""

    rank: int
    world_size: int
    device: torch.device
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    @property
    def is_logging_rank(self) -> bool:
        """The last rank: it sits on the last pipeline stage, where the loss is known."""
        return self.rank == self.world_size - 1

    @classmethod
    def from_environment(cls, device_preference: str = "auto", timeout_minutes: int = 10) -> "Topology":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = pick_device(device_preference, local_rank)
        init_process_group(device, timeout_minutes)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock timings mean something on GPUs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(GiB, what was measured): the CUDA allocator's peak, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "RSS"
