"""`python -m megalite.launch [torchrun's arguments] pretrain_gpt.py ...`: torchrun, whose exit status says
whether a stopped job saved.

torchrun forwards a SIGTERM or SIGINT it receives to its workers, waits `--shutdown-timeout` seconds (30 by
default) for them and SIGKILLs what is left; then it exits 1 with its own SignalException traceback, even when
the ranks saved and exited 0: a preempted job that saved looks failed, and a batch script cannot tell it from
a crash. This runs torchrun's launcher in-process (same arguments, same behaviour otherwise) and gives the
ranks a file to report a saved stop in (megalite/training/stopping.py). After a signal it exits 0 if the
ranks saved (their last line says where and that the same command resumes), else 128 + the signal's number,
with one line instead of the traceback and torchrun's per-worker warnings.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import parse_args, run

from megalite.training.stopping import REPORT_ENV, read_report

# torchrun's warnings while it forwards a signal: one per worker, repeated by each node's agent
_SIGNAL_CHATTER = ("death signal, shutting down workers", "closing signal")


def _quiet_about_signals(record: logging.LogRecord) -> bool:
    return not any(text in str(record.msg) for text in _SIGNAL_CHATTER)


@record
def main(argv: list[str] | None = None) -> int:
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_quiet_about_signals)
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megalite-launch-") as scratch:
        report = os.environ.setdefault(REPORT_ENV, str(Path(scratch) / "stop.json"))  # a batch script may set it
        Path(report).unlink(missing_ok=True)  # left by an earlier attempt of the same job
        try:
            run(args)
        except SignalException as stopped:
            return _status_after(stopped.sigval, report)
    return 0


def _status_after(received: signal.Signals, report: str) -> int:
    saved = read_report(report)
    if saved is not None:
        return 0
    print(f"megalite.launch: {received.name}: the ranks stopped without completing a save "
          "(see their last lines)", file=sys.stderr, flush=True)
    return 128 + received


if __name__ == "__main__":
    sys.exit(main())
