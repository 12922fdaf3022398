"""Where this process sits: rank, device, backend and the process groups it talks over.

The Topology is built once at start-up and handed to whatever needs a group; nothing
here is a module-level global, so a test can build several in one process. This is the
only module that touches CUDA device selection; everything else asks `topology.device`.
What CUDA reads from the environment when it starts is set before that (cuda_env.py).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.parallel.cuda_env import prepare_cuda_environment
from megalite.parallel.host_allocator import map_large_blocks


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


DENSE_AXES = ("tp", "cp", "dp", "pp")  # Megatron-LM's order, fastest-varying first
EXPERT_AXES = ("etp", "ep", "edp", "pp")  # the expert layers' grid over the same ranks ("MoE parallel folding")
GRIDS = {"dense": DENSE_AXES, "expert": EXPERT_AXES}


@dataclass(frozen=True)
class RankGrid:
    """Global ranks laid out along named axes, the first varying fastest.

    The dense grid (tp, cp, dp, pp) places every layer but the experts: tp fastest (it stays inside a
    node, where its many small collectives are cheap), then cp, dp, and pp slowest (Megatron-LM's order).
    The expert grid (etp, ep, edp, pp) lays the experts over the same ranks, Megatron-Core's "parallel
    folding": expert parallelism is carved out of the ranks of one pipeline stage (tp x cp x dp of them),
    not multiplied with them, so ep may exceed dp. Both grids share pp, so a stage's ranks are the same
    in both. Adding a parallelism means giving an axis a size, not rewriting the arithmetic."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def dense(cls, tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1) -> RankGrid:
        return cls(DENSE_AXES, (tp, cp, dp, pp))

    @classmethod
    def expert(cls, etp: int = 1, ep: int = 1, edp: int = 1, pp: int = 1) -> RankGrid:
        return cls(EXPERT_AXES, (etp, ep, edp, pp))

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> RankGrid:
        """The dense grid of `world_size` ranks; data parallelism takes whatever the other axes leave."""
        return cls.dense(tp, cp, _rest(world_size, tp * cp * pp, "tp * cp * pp"), pp)

    @classmethod
    def experts_for_world(cls, world_size: int, etp: int = 1, ep: int = 1, pp: int = 1) -> RankGrid:
        """The expert grid of `world_size` ranks; expert data parallelism takes what etp, ep and pp leave."""
        return cls.expert(etp, ep, _rest(world_size, etp * ep * pp, "etp * ep * pp"), pp)

    def __getattr__(self, axis: str) -> int:  # grid.tp, grid.dp, ...: an axis's size
        if axis in type(self).__dataclass_fields__ or axis.startswith("__"):
            raise AttributeError(axis)
        return self.size(axis)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"unknown rank-grid axis {axis!r}; the axes are {self.axes}")
        return self.sizes[self.axes.index(axis)]

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid of {self.world_size} ranks")
        coords = {}
        for axis, size in zip(self.axes, self.sizes):
            rank, coords[axis] = divmod(rank, size)
        return coords

    def rank(self, coords: dict[str, int]) -> int:
        """The global rank at `coords` (axes left out are at 0)."""
        rank, stride = 0, 1
        for axis, size in zip(self.axes, self.sizes):
            rank += coords.get(axis, 0) * stride
            stride *= size
        return rank

    def index_in(self, rank: int, axes: tuple[str, ...]) -> int:
        """`rank`'s position in its group along `axes` (groups list their ranks in ascending order)."""
        coords, index, stride = self.coords(rank), 0, 1
        for axis in self.axes:
            if axis in axes:
                index += coords[axis] * stride
                stride *= self.size(axis)
        return index

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along `axes`, each in ascending rank order, the groups
        in ascending order of their first rank: the same list on every rank, as new_group needs."""
        unknown = set(axes) - set(self.axes)
        if unknown:
            raise ValueError(f"unknown rank-grid axes {sorted(unknown)}; the axes are {self.axes}")
        slowest_first = tuple(reversed(self.axes))
        fixed = [axis for axis in slowest_first if axis not in axes]
        free = [axis for axis in slowest_first if axis in axes]
        return [[self.rank({**dict(zip(fixed, at)), **dict(zip(free, along))})
                 for along in itertools.product(*(range(self.size(axis)) for axis in free))]
                for at in itertools.product(*(range(self.size(axis)) for axis in fixed))]


def _rest(world_size: int, product: int, what: str) -> int:
    if world_size % product:
        raise ValueError(f"world size {world_size} is not a multiple of {what} = {product}")
    return world_size // product


# The process groups a rank joins: (grid, axes) -> the description NCCL's errors and megalite's timeout
# message show. Groups of one rank are made too (collectives over them cost nothing), except along axes
# of size 1 that a layout does not use at all (cp, the expert grid): see Topology._wanted.
GROUPS: dict[tuple[str, tuple[str, ...]], str] = {
    ("dense", ("tp",)): "tensor-parallel",
    ("dense", ("cp",)): "context-parallel",
    ("dense", ("dp",)): "data-parallel",
    ("dense", ("cp", "dp")): "data-and-context-parallel",
    ("dense", ("pp",)): "pipeline-parallel",
    ("dense", ("tp", "cp")): "tensor-and-context-parallel",
    ("expert", ("etp",)): "expert-tensor-parallel",
    ("expert", ("ep",)): "expert-parallel",
    ("expert", ("edp",)): "expert-data-parallel",
    ("expert", ("etp", "ep")): "expert-tensor-and-expert-parallel",
}


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
    """This process's place in the two rank grids and the process groups along their axes.

    Built once, after the process group exists, and handed to whatever needs a group. Groups are named
    by their axes (`group("tp", "cp")`, `group("ep", grid="expert")`), from the one table GROUPS. With
    ep = etp = 1 and no experts in the model the expert grid makes no groups, and the dense groups are
    exactly those of every layout before experts.
    """

    rank: int
    world_size: int
    device: torch.device
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    experts: bool = False  # the model has expert layers (their groups are made even at ep = etp = 1)
    timeout_minutes: float | None = None  # collective timeout of the groups (None: torch's default)
    grids: dict[str, RankGrid] = field(init=False, repr=False)
    groups: dict[tuple[str, tuple[str, ...]], dist.ProcessGroup] = field(init=False, repr=False)
    embedding_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.grids = {"dense": RankGrid.for_world(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp)}
        if self.experts or self.ep * self.etp > 1:
            self.grids["expert"] = RankGrid.experts_for_world(self.world_size, etp=self.etp, ep=self.ep, pp=self.pp)
        timeout = timedelta(minutes=self.timeout_minutes) if self.timeout_minutes is not None else None
        self.groups = {}
        for (grid, axes), name in GROUPS.items():
            if self._wanted(grid, axes):
                self.groups[(grid, axes)] = _my_group(self.grids[grid].groups(axes), self.rank, name, timeout)
        if self.pp > 1:  # the first and last stage of each pipeline: the tied embedding's two copies
            ends = [[ranks[0], ranks[-1]] for ranks in self.grids["dense"].groups(("pp",))]
            self.embedding_group = _my_group(ends, self.rank, "embedding", timeout)

    def _wanted(self, grid: str, axes: tuple[str, ...]) -> bool:
        """Context-parallel groups only with cp > 1 (data-and-context-parallel is then data-parallel), expert
        groups only with an expert grid."""
        if grid not in self.grids:
            return False
        return grid != "dense" or "cp" not in axes or self.cp > 1

    def group(self, *axes: str, grid: str = "dense") -> dist.ProcessGroup:
        """This rank's group along `axes` of `grid` (one of the GROUPS table's)."""
        if (grid, axes) not in GROUPS:
            raise ValueError(f"no {grid} process group along {axes}; the groups are {sorted(GROUPS)}")
        if grid == "dense" and "cp" in axes and len(axes) > 1 and self.cp == 1:
            axes = tuple(axis for axis in axes if axis != "cp")  # cp = 1 makes no cp groups: the same ranks
        if (grid, axes) not in self.groups:
            raise ValueError(f"this layout made no {grid} group along {axes} (no expert layers, or cp = 1)")
        return self.groups[(grid, axes)]

    def size(self, *axes: str, grid: str = "dense") -> int:
        """How many ranks differ along `axes` of `grid`."""
        return math.prod(self.grids[grid].size(axis) for axis in axes)

    def coord(self, *axes: str, grid: str = "dense") -> int:
        """This rank's position in its group along `axes` of `grid`."""
        return self.grids[grid].index_in(self.rank, axes)

    def axes(self, grid: str = "dense") -> tuple[str, ...]:
        return self.grids[grid].axes

    def placement_coord(self, grid: str = "dense") -> Callable[[str], tuple[int, int]]:
        """axis -> (this rank's index along it, its size) on `grid`: what a Placement asks of a rank."""
        return lambda axis: (self.coord(axis, grid=grid), self.size(axis, grid=grid))

    @property
    def grid(self) -> RankGrid:
        return self.grids["dense"]

    @property
    def dp(self) -> int:
        return self.grid.dp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights (data- and context-parallel replicas): what gradients are
        reduced over and optimizer state is sharded over; `dp_cp_rank` is this rank's place among them."""
        return self.size("cp", "dp")

    tp_rank = property(lambda self: self.coord("tp"))
    cp_rank = property(lambda self: self.coord("cp"))
    dp_rank = property(lambda self: self.coord("dp"))
    pp_rank = property(lambda self: self.coord("pp"))
    dp_cp_rank = property(lambda self: self.coord("cp", "dp"))
    tp_group = property(lambda self: self.group("tp"))
    dp_cp_group = property(lambda self: self.group("cp", "dp"))
    pp_group = property(lambda self: self.group("pp"))
    cp_group = property(lambda self: self.group("cp") if self.cp > 1 else None)

    def named_groups(self) -> dict[str, dist.ProcessGroup]:
        """This rank's groups by the description they were created with."""
        groups = [*self.groups.values(), self.embedding_group]
        return {group.group_desc: group for group in groups if group is not None}

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Element-wise maximum over every rank, in one collective: how ranks agree on flags (any rank's
        overflow, SIGTERM or finished write counts for all)."""
        if self.world_size == 1:
            return values
        flags = torch.tensor(values, dtype=torch.float32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags.tolist()

    def max_over_ranks_later(self, values: list[float]) -> Callable[[], list[float]]:
        """`max_over_ranks` without waiting for it: the host-to-device copy, the collective and the copy back
        are queued now (pinned memory, no wait), and the returned function reads the result. Read one step
        later, the GPU finished it while the next step was queued, so the host waits for nothing (unless it
        ran more than a step ahead of its GPU). On the CPU the collective runs when queued."""
        if self.world_size == 1:
            return lambda: values
        if self.device.type != "cuda":
            flags = torch.tensor(values, dtype=torch.float32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            return flags.tolist
        flags = torch.tensor(values, dtype=torch.float32).pin_memory().to(self.device, non_blocking=True)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True).copy_(flags, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list[float]:
            copied.synchronize()
            return host.tolist()

        return read

    @classmethod
    def from_config(cls, rank: int, world_size: int, device: torch.device, parallel: ParallelConfig,
                    experts: bool = False) -> Topology:
        """The topology `parallel` asks for, on a process group that already exists."""
        return cls(rank, world_size, device, tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, ep=parallel.ep,
                   etp=parallel.etp, experts=experts, timeout_minutes=parallel.timeout_minutes)

    @classmethod
    def from_environment(cls, device_preference: str = "auto", parallel: ParallelConfig | None = None,
                         experts: bool = False) -> Topology:
        """Join the job torchrun started (or form a one-process group) and build the topology on it."""
        parallel = parallel or ParallelConfig()
        map_large_blocks()  # before training frees its first bucket-sized buffer (host_allocator.py)
        # read once, when CUDA starts: before pick_device's first CUDA call
        line = prepare_cuda_environment(parallel) if device_preference != "cpu" else None
        device = pick_device(device_preference, int(os.environ.get("LOCAL_RANK", 0)))
        if line is not None and device.type == "cuda":
            print(line, flush=True)
        init_process_group(device, parallel.timeout_minutes)
        return cls.from_config(dist.get_rank(), dist.get_world_size(), device, parallel, experts)


def release_process_groups() -> None:
    """Destroy every process group while the interpreter is fully alive. What holds groups in reference cycles
    (a trainer, its topology) is collected first, so each gloo group's worker threads are joined now: joined
    during interpreter shutdown instead, releasing a tensor they still hold aborts the process (SIGABRT,
    "terminate called without an active exception"), now and then, after a run that succeeded."""
    gc.collect()
    dist.destroy_process_group()


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


def device_memory(device: torch.device) -> tuple[str, int] | None:
    """(name, bytes) of a GPU's memory, for comparing the planner's estimate with it; None on a CPU."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    return properties.name, properties.total_memory
