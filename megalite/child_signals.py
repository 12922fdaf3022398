"""A rank's child processes (data workers, the W&B process) leave SIGTERM and SIGINT to the rank.

torchrun forwards these signals to each worker's whole process group, Slurm sends them to every process of a
job step, and a terminal's Ctrl-C reaches its foreground process group: a child that died of one would take
its rank down (torch's SIGCHLD handler raises for a dead data worker; W&B would fall back to offline) before
the rank could stop and save (training/stopping.py). So each child ignores them from its first instruction,
and the rank shuts its children down itself.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(*_: object) -> None:
    """Called first thing in a child (takes and ignores a DataLoader's worker id)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def children_start_deaf() -> Iterator[None]:
    """Children started in this block (from this thread) hold the stop signals blocked until they ignore them:
    a signal during their start-up (a spawned W&B process imports for seconds) would otherwise end them. The
    parent's signals wait meanwhile (other threads, or this one after the block, receive them)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
