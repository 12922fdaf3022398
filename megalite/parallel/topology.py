"""Where this process sits: rank, device, backend and the process groups it talks over.

The Topology is built once at start-up and handed to whatever needs a group; nothing
here is a module-level global, so a test can build several in one process. This is the
only module that touches CUDA device selection; everything else asks `topology.device`.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(preference: str, local_rank: int) -> torch.device:
    """cuda:(LOCAL_RANK mod visible devices) when asked for (or 'auto' and available), else cpu. The
    modulo serves launchers that give each process one GPU through CUDA_VISIBLE_DEVICES (each then
    sees device 0 only, whatever its LOCAL_RANK)."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but torch sees no CUDA device; use --train.device=cpu or auto")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout_minutes: float = 10.0) -> None:
    """Join the job torchrun started, or form a one-process group in memory.

    A single process still gets a real process group (over an in-process store), so
    collectives run through the same code path at every world size.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # On a timeout torch's NCCL watchdog by default kills the process from its own thread, before
        # Python can say which rank and group hung. CleanUpOnly (2) aborts the hung communicators and
        # leaves the error to the training thread, which exits with megalite's message (timeouts.py).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = timedelta(minutes=timeout_minutes)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                **_attempt_store(timeout))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _attempt_store(timeout: timedelta) -> dict:
    """Under torchrun the workers share the agent's store, and a restarted worker group
    (`--max-restarts`) gets the same store back with the failed attempt's keys still in it
    (peer addresses, barrier counters): a new worker can read a dead peer's address and fail or
    hang at start. Each attempt therefore works under its own key prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"megalite/attempt_{attempt}", agent), "rank": rank, "world_size": world_size}


AXES = ("tp", "cp", "ep", "dp", "pp")  # Megatron-LM's order, fastest-varying first


@dataclass(frozen=True)
class RankGrid:
    """Global ranks laid out along named axes, tp varying fastest (it stays inside a node, where its
    many small collectives are cheap), then cp, ep, dp, and pp slowest (Megatron-LM's order).

    Adding a parallelism means giving its axis a size, not rewriting the arithmetic: with cp = ep = 1
    the layout is exactly (pp, dp, tp), the one every checkpoint so far was written with."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> "RankGrid":
        """The grid of `world_size` ranks; data parallelism takes whatever the other axes leave."""
        model = tp * cp * ep * pp
        if world_size % model:
            raise ValueError(f"world size {world_size} is not a multiple of tp * cp * ep * pp = {model}")
        return cls(tp=tp, cp=cp, ep=ep, dp=world_size // model, pp=pp)

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in AXES)

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise ValueError(f"unknown rank-grid axis {axis!r}; the axes are {AXES}")
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid of {self.world_size} ranks")
        coords = {}
        for axis in AXES:
            rank, coords[axis] = divmod(rank, self.size(axis))
        return coords

    def rank(self, coords: dict[str, int]) -> int:
        """The global rank at `coords` (axes left out are at 0)."""
        rank, stride = 0, 1
        for axis in AXES:
            rank += coords.get(axis, 0) * stride
            stride *= self.size(axis)
        return rank

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along `axes`, each in ascending rank order, the groups
        in ascending order of their first rank: the same list on every rank, as new_group needs."""
        unknown = set(axes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown rank-grid axes {sorted(unknown)}; the axes are {AXES}")
        slowest_first = tuple(reversed(AXES))
        fixed = [axis for axis in slowest_first if axis not in axes]
        free = [axis for axis in slowest_first if axis in axes]
        return [[self.rank({**dict(zip(fixed, at)), **dict(zip(free, along))})
                 for along in itertools.product(*(range(self.size(axis)) for axis in free))]
                for at in itertools.product(*(range(self.size(axis)) for axis in fixed))]


def _my_group(groups: list[list[int]], rank: int, name: str, timeout: timedelta | None) -> dist.ProcessGroup | None:
    """Create every group of `groups` (all ranks must call this with the same list, in the same order) and
    return the one holding `rank`. `timeout`: torch gives new groups its 30-minute default, not the world
    group's, so the collective timeout must be passed to each. `name` becomes the group's description,
    which NCCL's error messages and megalite's timeout message show."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout, group_desc=name)
        if rank in ranks:
            mine = group
    return mine


@dataclass
class Topology:
    """This process's place in the rank grid and the process groups along its axes.

    Built once, after the process group exists, and handed to whatever needs a group.
    """

    rank: int
    world_size: int
    device: torch.device
    tp: int = 1
    pp: int = 1
    timeout_minutes: float | None = None  # collective timeout of the groups (None: torch's default)
    cp: int = 1
    grid: RankGrid = field(init=False, repr=False)
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    mp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.grid = RankGrid.for_world(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp)
        coords = self.grid.coords(self.rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = coords["tp"], coords["cp"], coords["dp"], coords["pp"]
        self.dp_cp_rank = self.dp_rank * self.cp + self.cp_rank
        timeout = timedelta(minutes=self.timeout_minutes) if self.timeout_minutes is not None else None
        grid, rank = self.grid, self.rank
        self.tp_group = _my_group(grid.groups(("tp",)), rank, "tensor-parallel", timeout)
        self.dp_group = _my_group(grid.groups(("dp",)), rank, "data-parallel", timeout)
        self.dp_cp_group = self.dp_group
        if self.cp > 1:  # cp ranks hold the same weights: gradients and optimizer shards span dp x cp
            self.cp_group = _my_group(grid.groups(("cp",)), rank, "context-parallel", timeout)
            self.dp_cp_group = _my_group(grid.groups(("cp", "dp")), rank, "data-and-context-parallel", timeout)
        self.pp_group = _my_group(grid.groups(("pp",)), rank, "pipeline-parallel", timeout)
        self.mp_group = _my_group(grid.groups(("tp", "pp")), rank, "model-parallel", timeout)
        if self.pp > 1:  # the first and last stage of each pipeline: the tied embedding's two copies
            ends = [[ranks[0], ranks[-1]] for ranks in grid.groups(("pp",))]
            self.embedding_group = _my_group(ends, rank, "embedding", timeout)

    @property
    def dp(self) -> int:
        return self.grid.dp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights (data- and context-parallel replicas): what gradients are
        reduced over and optimizer state is sharded over; `dp_cp_rank` is this rank's place among them."""
        return self.grid.dp * self.cp

    def named_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """This rank's groups by the description they were created with."""
        groups = (self.tp_group, self.cp_group, self.dp_group, self.dp_cp_group, self.pp_group, self.mp_group,
                  self.embedding_group)
        return {group.group_desc: group for group in groups if group is not None}

    @property
    def is_logging_rank(self) -> bool:
        """The last rank: it sits on the last pipeline stage, where the loss is known."""
        return self.rank == self.world_size - 1

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Element-wise maximum over every rank, in one collective: how ranks agree on flags (any rank's
        overflow, SIGTERM or finished write counts for all)."""
        if self.world_size == 1:
            return values
        flags = torch.tensor(values, dtype=torch.float32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags.tolist()

    @classmethod
    def from_environment(cls, device_preference: str = "auto", timeout_minutes: float = 10.0, tp: int = 1,
                         pp: int = 1, cp: int = 1) -> "Topology":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = pick_device(device_preference, local_rank)
        init_process_group(device, timeout_minutes)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, tp=tp, pp=pp,
                   timeout_minutes=timeout_minutes, cp=cp)


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
