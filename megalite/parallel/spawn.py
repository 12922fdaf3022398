"""Run a function on N fresh gloo processes on this machine and collect what each returns.

For tools and tests that measure or check several ranks without torchrun: one free port,
one process group per spawn, results gathered to rank 0 and handed back to the caller
(through a file this session wrote itself, so unpickling it runs nothing foreign). Asked for (`observed_groups`),
the groups are observed gloo groups (parallel/observed.py): an observer such as the NCCL-rule recorder sees every
call they make.

The processes start from a fork server that imported torch and megalite's training code once
(`PRELOADED`), not as new interpreters each importing them again: a spawn cost each rank two to four
seconds of imports on a 2-core machine, most of a tiny test's time. The server never runs torch, so
it forks without threads; each rank then gets the caller's environment as it is now (a fork server's
children would otherwise keep the environment it started with). Independent work without a process group (the
dry run's simulated ranks) runs on the same server's processes, one per core (`map_in_processes`).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.parallel import observed
from megalite.parallel.host_allocator import map_large_blocks
from megalite.parallel.topology import release_process_groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOADED = ["torch", "torch.distributed", "megalite.training.pretrain", "megalite.planning.measure"]


def _worker(rank: int, world_size: int, port: int, threads: int | None, fn: Callable, args: tuple, out: str,
            environ: dict[str, str], backend: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    if threads:
        torch.set_num_threads(threads)
    map_large_blocks()  # host memory as a training process has it (Topology.from_environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world_size))  # as torchrun
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, fn(rank, world_size, *args))
        if rank == 0:  # a file, not a pipe: a large result would block the writer until the parent reads
            Path(out).write_bytes(pickle.dumps(gathered))
    finally:
        release_process_groups()


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, threads: int | None = 1,
                 observed_groups: bool = False) -> list[Any]:
    """fn(rank, world_size, *args) on every rank (`threads` intra-op threads each, None = torch's
    default); returns the per-rank results in rank order. fn must be importable (spawned processes).
    `observed_groups`: the ranks' groups are observed ones (parallel/observed.py), for a CommRecorder or a
    meter; otherwise plain gloo, as training has (torch.compile traces collectives on plain groups only)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pickle")
        mp.set_forkserver_preload(PRELOADED)  # read when the server starts: the first call of the session
        backend = observed.GLOO if observed_groups else "gloo"
        mp.start_processes(_worker, args=(world_size, free_port(), threads, fn, args, out, dict(os.environ), backend),
                           nprocs=world_size, join=True, start_method="forkserver")
        return pickle.loads(Path(out).read_bytes())


def available_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_in_processes(calls: Sequence[tuple[Callable[..., Any], tuple]], workers: int) -> list[Any]:
    """[fn(*args) for fn, args in calls], on up to `workers` processes of the fork server at once (in this
    process when one worker, or one call, is all there is): for independent, single-threaded work that takes
    seconds each. Each fn must be importable, its arguments and result must pickle."""
    if min(workers, len(calls)) <= 1:
        return [fn(*args) for fn, args in calls]
    mp.set_forkserver_preload(PRELOADED)
    with ProcessPoolExecutor(min(workers, len(calls)), mp.get_context("forkserver")) as pool:
        futures = [pool.submit(fn, *args) for fn, args in calls]
        return [future.result() for future in futures]
