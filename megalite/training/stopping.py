"""Stopping a run on a signal and saving it, however the cluster sends the signal.

What reaches a rank:
- torchrun forwards a SIGTERM or SIGINT (Ctrl-C) it receives to each worker's process group, which holds
  the rank, its data workers and its W&B process;
- Slurm (scancel, preemption, srun forwarding a signal) signals every process of the job step at once, so a
  rank can get SIGTERM twice (directly and from torchrun);
- a user or a scheduler may signal one rank only.
The data workers and the W&B process ignore both signals (megalite/child_signals.py): their rank
stops them. The rank's handler, installed before either starts, only notes the signal. The first SIGTERM or
SIGINT asks the run to stop and save; a SIGINT after an earlier signal, or any signal after a SIGINT, aborts
at once without saving (a second Ctrl-C; torchrun follows a second Ctrl-C with SIGTERM), so a double
SIGTERM from Slurm still saves.

Every rank must stop after the same step. Each step ends with a two-number all-reduce (MAX) of the ranks'
requests (a signal, train.exit_duration_mins passed) that the host reads one step later
(Topology.max_over_ranks_later): on a GPU it has finished by then, so agreeing never stalls the device. A
signal that arrives before step N's vote is queued stops the run after step N + 1.

`MEGALITE_STOP_REPORT` (set by `python -m megalite.launch` or a batch script) names a file that each node's
local rank 0 writes once a run stopped by a signal has saved: a launcher that was signalled itself learns from
it that the job saved, and the Slurm script that it may requeue the job.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from megalite.child_signals import STOP_SIGNALS
from megalite.parallel.topology import Topology

REPORT_ENV = "MEGALITE_STOP_REPORT"
ABORTED = 128 + signal.SIGINT  # the shell's status for a process ended by Ctrl-C


class StopSignals:
    """The stop signals this process received between `install()` and `restore()` (installed in the main
    thread only: elsewhere, as in a test's thread, nothing is)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.pid = os.getpid()
        self.previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        return self

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a data worker forked with this handler, before it ignores the signal
            return
        if self.received is not None and signal.SIGINT in (signum, self.received):
            _abort()
        self.received = self.received or signal.Signals(signum)


def _abort() -> None:
    """Exit now without saving (a checkpoint being written stays unpublished, the previous one current):
    one line from rank 0, no traceback. The data workers and the W&B process notice their parent is gone."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"interrupted again: aborted without saving; the last complete checkpoint is unchanged\n")
    os._exit(ABORTED)


class StopVote:
    """Whether every rank should stop now, asked once per step (collective)."""

    def __init__(self, topology: Topology, signals: StopSignals, exit_duration_mins: float | None,
                 started: float) -> None:
        self.topology, self.signals = topology, signals
        self.deadline = None if exit_duration_mins is None else started + 60 * exit_duration_mins
        self.previous = lambda: [0.0, 0.0]  # before the first step nobody asked

    def after_step(self) -> tuple[signal.Signals | None, bool]:
        """(the signal that stops the run, if any; whether the time limit passed), as the ranks agreed on
        them one step ago; queues this step's vote."""
        received = self.signals.received
        late = self.deadline is not None and time.monotonic() >= self.deadline
        agreed, self.previous = self.previous(), self.topology.max_over_ranks_later([received or 0, float(late)])
        return (signal.Signals(int(agreed[0])) if agreed[0] else None), bool(agreed[1])


def write_report(stopped_by: signal.Signals, step: int, checkpoint: Path) -> None:
    """Tell the launcher (MEGALITE_STOP_REPORT) that the run stopped on `stopped_by` and saved `checkpoint`:
    written by each node's local rank 0 once the save is complete on every rank."""
    path = os.environ.get(REPORT_ENV)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    report = {"stopped_by": stopped_by.name, "step": step, "checkpoint": str(checkpoint)}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report) + "\n")
    tmp.replace(path)


def read_report(path: str) -> dict | None:
    """The report a node's ranks wrote, or None if they saved nothing."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
