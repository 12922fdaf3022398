"""Weights & Biases in a process of its own, so that W&B can never stop or stall a training run.

Without network or credentials, wandb retries for about 100 s and then raises, and a run whose
server disappears blocks in `finish()` while it retries uploads. On a cluster that would throw
away a job that queued for hours. So the logging rank hands records to a child process that
owns wandb; the training thread only appends to a queue. A supervising thread watches the
child: an online start that has not answered within `logging.wandb_timeout`, or a child that
fails or dies later, is replaced by an offline run with the same id (resume="allow") that
receives every record logged so far, with one warning naming the `wandb sync` command and a
record of the fallback in the metrics file. Closing waits at most `logging.wandb_timeout` for
W&B to finish; a restarted run passes the same id and continues the same W&B run (offline: in one
directory, wandb_offline.py).
"""

from __future__ import annotations

import multiprocessing
import queue
import secrets
import shutil
import string
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megalite.training.wandb_offline import earlier_parts, history_until

_RESTARTS = 3  # offline restarts after failures before W&B is given up for this run


def new_run_id() -> str:
    """An id of W&B's shape, chosen before W&B starts so every rank and every restart can agree on it."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _serve(settings: dict[str, Any], timeout: float, records: Any, status: Any) -> None:
    """The child process: one W&B run, fed from `records` until ("finish", exit code)."""
    import wandb

    try:
        run = wandb.init(**settings, settings=wandb.Settings(init_timeout=timeout))
    except Exception as error:  # noqa: BLE001 - whatever W&B raises, the parent falls back
        status.put(("failed", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"))
        return
    status.put(("ready", run.dir))
    while True:
        kind, payload, step = records.get()
        if kind == "finish":
            run.finish(exit_code=payload)
            status.put(("finished", run.dir))
            return
        try:
            run.log(payload, step=step)
        except Exception as error:  # noqa: BLE001
            status.put(("failed", f"{type(error).__name__}: {error}"))
            return


class WandbLogger:
    """The training process's side: `log` never blocks; `close` waits at most `timeout` seconds.
    `say` prints a line for the user; `note` appends a record to the metrics file. An offline run resumed at
    `start_step` logs the history of its earlier offline directories again and removes them once finished."""

    def __init__(self, settings: dict[str, Any], mode: str, timeout: float, say: Callable[[str], None],
                 note: Callable[[dict[str, Any]], None], start_step: int = 0) -> None:
        self.settings, self.timeout, self.say, self.note = settings, timeout, say, note
        self.context = multiprocessing.get_context("spawn")
        self.parts = earlier_parts(Path(settings["dir"]) / "wandb", self.run_id) if mode == "offline" else []
        self.history: list[tuple[dict[str, Any], int]] = history_until(self.parts, start_step)
        self.lock = threading.Lock()
        self.closing, self.exit_code, self.finished = False, 0, threading.Event()
        self.dir: str | None = None
        self.reason: str | None = None  # why the run fell back to offline, until the offline run is up
        self.restarts = 0
        self._start(mode)
        self.supervisor = threading.Thread(target=self._supervise, name="wandb-supervisor", daemon=True)
        self.supervisor.start()

    @property
    def run_id(self) -> str:
        return self.settings["id"]

    def _start(self, mode: str) -> None:
        self.mode, self.ready = mode, False
        self.records, self.status = self.context.Queue(), self.context.Queue()
        self.started = time.monotonic()
        self.process = self.context.Process(target=_serve, args=({**self.settings, "mode": mode}, self.timeout,
                                                                 self.records, self.status), daemon=True)
        self.process.start()
        for record, step in self.history:  # what a replaced child or the earlier parts of the run logged
            self.records.put(("log", record, step))

    def log(self, record: dict[str, Any], step: int) -> None:
        with self.lock:
            self.history.append((record, step))
            self.records.put(("log", record, step))

    def close(self, exit_code: int = 0) -> str | None:
        """Finish the W&B run; returns its files directory (None if W&B never started)."""
        with self.lock:
            self.closing, self.exit_code = True, exit_code
            self.records.put(("finish", exit_code, 0))
        if not self.finished.wait(self.timeout):
            self.process.kill()
            where = f"`wandb sync {Path(self.dir).parent}` uploads it" if self.dir else "nothing was written"
            self.say(f"warning: W&B did not finish within logging.wandb_timeout={self.timeout:g} s; "
                     f"stopped it ({where})")
        elif self.dir and self.parts:
            self._remove_earlier_parts(Path(self.dir).parent)
        return self.dir

    def _remove_earlier_parts(self, own: Path) -> None:
        """The earlier offline directories of this run, now that `own` holds their history too."""
        earlier = [part for part in self.parts if part != own]
        for part in earlier:
            shutil.rmtree(part, ignore_errors=True)
        if earlier:
            self.say(f"W&B: {own} holds the whole run; removed the {len(earlier)} offline "
                     f"{'directory' if len(earlier) == 1 else 'directories'} of its earlier parts")

    def _supervise(self) -> None:
        while not self.finished.is_set():
            try:
                kind, detail = self.status.get(timeout=0.2)
            except queue.Empty:
                kind, detail = self._silence()
                if kind is None:
                    continue
            if kind == "ready":
                self._up(detail)
            elif kind == "finished":
                self.dir = detail
                self.finished.set()
            else:
                self._failed(detail)

    def _silence(self) -> tuple[str | None, str]:
        """A failure the child cannot report: it died, or an online start took longer than allowed or
        still runs when training ends."""
        if not self.process.is_alive():
            return "failed", f"the W&B process exited with code {self.process.exitcode}"
        if self.mode == "online" and not self.ready:
            if time.monotonic() - self.started > self.timeout:
                return "failed", f"no answer from the W&B server within logging.wandb_timeout={self.timeout:g} s"
            if self.closing:  # training is over: waiting longer for the server would only delay the exit
                return "failed", "the W&B server had not answered by the end of training"
        return None, ""

    def _up(self, directory: str) -> None:
        self.ready, self.dir = True, directory
        if self.reason is None:
            return
        command = f"wandb sync {Path(directory).parent}"
        self.say(f"warning: W&B went offline ({self.reason}); training continues and logs to {Path(directory).parent}; "
                 f"upload it later with `{command}`")
        self.note({"wandb_fallback": "offline", "reason": self.reason, "sync_command": command,
                   "step": self.history[-1][1] if self.history else 0})
        self.reason = None

    def _failed(self, reason: str) -> None:
        """Replace the child by an offline run that receives every record again (also while closing:
        close() still bounds the wait)."""
        self.process.kill()
        if self.restarts >= _RESTARTS:
            self.say(f"warning: W&B stopped ({reason}); the run goes on without it")
            self.finished.set()
            return
        self.restarts += 1
        self.reason = reason
        with self.lock:
            self._start("offline")
            if self.closing:
                self.records.put(("finish", self.exit_code, 0))
