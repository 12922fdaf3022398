"""pretrain_gpt.py held at a known step, for tests that signal, stop or kill a worker.

Run in place of pretrain_gpt.py (torchrun takes it as the script) with HOLD_AFTER_STEP=N and
HOLD_DIR=DIR in the environment: once a rank has finished its N-th step in this process (logged,
voted on, saved), it writes DIR/held_<rank> and waits for DIR/go before the next one. A test
waits for every rank's file, acts (a signal, SIGSTOP, SIGKILL), then writes DIR/go: what it did
lands at that step however fast or slow the machine is. A restarted worker counts its steps
anew and does not wait once DIR/go exists.

HOLD_SAVE stands in for a slow or failing file system in a rank's checkpoint writes: `SECONDS` (a
number) makes each rank's write take that long; `wait` writes DIR/saving_<rank> and waits for
DIR/save_go; `fail` raises OSError.
"""

import os
import runpy
import sys
import time
from pathlib import Path

import megalite.checkpoint.local as checkpoint_module
import megalite.training.pretrain as pretrain_module

ROOT = Path(__file__).resolve().parents[1]
AFTER, WHERE = int(os.environ["HOLD_AFTER_STEP"]), Path(os.environ["HOLD_DIR"])
step, steps_done = pretrain_module.train_step, [0]


write, SAVE = checkpoint_module.write_rank_files, os.environ.get("HOLD_SAVE")


def _wait_for(name: str) -> None:
    deadline = time.monotonic() + 600  # a test that died without releasing the job leaves no process behind
    while not (WHERE / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"held_pretrain.py: {WHERE / name} did not appear within 600 s; giving up")
        time.sleep(0.01)


def held_step(trainer, batches):
    if steps_done[0] == AFTER:
        (WHERE / f"held_{os.environ.get('RANK', '0')}").touch()
        _wait_for("go")
    steps_done[0] += 1
    return step(trainer, batches)


def slow_write(tmp, rank, *args):
    if SAVE == "fail":
        raise OSError(f"held_pretrain.py: HOLD_SAVE=fail: no space left writing {tmp}")
    if SAVE == "wait":
        (WHERE / f"saving_{rank}").touch()
        _wait_for("save_go")
    else:
        time.sleep(float(SAVE))
    return write(tmp, rank, *args)


pretrain_module.train_step = held_step
if SAVE:
    checkpoint_module.write_rank_files = slow_write
sys.argv[0] = str(ROOT / "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
