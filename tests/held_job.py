"""A training job under torchrun (or `python -m megalite.launch`) on CPU processes, held after a known step
(tests/held_pretrain.py), for tests that signal, stop or kill it: what a test does lands at that step
however fast or slow the machine is."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
LAUNCH = (sys.executable, "-m", "megalite.launch")


class Job:
    """Output in `tmp/torchrun.log`; every rank held after step `hold_after` until `release`. `env` adds to the
    environment (HOLD_SAVE: tests/held_pretrain.py); `session`: the launcher leads a process group of its own,
    as a terminal's foreground job does (a Ctrl-C is SIGINT to that group)."""

    def __init__(self, tmp: Path, nproc: int, args: list[str], *launcher: str, hold_after: int,
                 command: tuple[str, ...] = TORCHRUN, env: dict[str, str] | None = None, session: bool = False) -> None:
        self.log, self.nproc, self.holds = tmp / "torchrun.log", nproc, tmp / "holds"
        self.holds.mkdir(exist_ok=True)
        for stale in self.holds.iterdir():  # a previous job's (the same command run again)
            stale.unlink()
        cmd = [*command, "--standalone", f"--nproc_per_node={nproc}", *launcher,
               str(ROOT / "tests" / "held_pretrain.py"), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HOLD_AFTER_STEP": str(hold_after), "HOLD_DIR": str(self.holds),
               **(env or {})}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                         start_new_session=session)

    def wait_until_held(self) -> None:
        """Every rank finished its step `hold_after` and waits for `release`."""
        self.wait_for_files("held")

    def wait_for_files(self, prefix: str) -> None:
        """Every rank wrote HOLD_DIR/<prefix>_<rank>."""
        self.wait_until(lambda: all((self.holds / f"{prefix}_{rank}").exists() for rank in range(self.nproc)))

    def release(self, name: str = "go") -> None:
        (self.holds / name).touch()

    def output(self) -> str:
        return self.log.read_text()

    def wait_until(self, condition, timeout: float = 300) -> None:
        """Poll until `condition()` holds; fail if the job ends first."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, (f"the job ended (exit {self.proc.returncode}) before the test acted:\n"
                                              f"{self.output()[-3000:]}")
            assert time.monotonic() < deadline, f"condition not reached in {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.05)

    def workers(self) -> dict[int, psutil.Process]:
        """The worker processes torchrun started, by global rank."""
        found = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                env = child.environ()
            except psutil.Error:
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = child
        return found

    def processes(self) -> list[psutil.Process]:
        """The launcher and every process below it (ranks, data workers, W&B)."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def finish(self, timeout: float = 300) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the job did not end in {timeout} s:\n{self.output()[-3000:]}")
        return self.output()
