"""Checkpoints that survive failures and load into any layout (issue 7):

- a checkpoint saved at tp2 x pp2 (vp2) x dp2 with the distributed optimizer resumes at
  (tp1, pp4, dp2), (tp4, pp1, dp2) and one device with the uninterrupted run's losses, and
  bit-exactly at its own layout;
- a worker killed with SIGKILL under `torchrun --max-restarts=1`: the job restarts, resumes from
  the latest checkpoint and ends with the uninterrupted run's loss;
- a rank that hangs (SIGSTOP) makes the others fail after parallel.timeout_minutes, naming it;
- SIGKILL in the middle of a save (sync or async, before a rank's listing or inside the publish)
  leaves the previous checkpoint intact and `latest` on it; the next run resumes from it and
  removes the stale temporary directory;
- asynchronous saves write the same checkpoints as synchronous ones.

Ranks run as gloo processes on CPU: several in-process `pretrain` calls per spawn where only
the layout changes (megalite.parallel.spawn), torchrun where the launcher's behaviour is the
point (restarts, signals to workers), a plain subprocess where the process must kill itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from distributed import metrics as read_metrics
from distributed import run_ranks
from held_job import Job
from safetensors.torch import load_file

from megalite.checkpoint.files import problem_with
from megalite.config_cli import parse_config
from megalite.training.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0",
         "--train.device=cpu"]


def _losses(args: list[str]) -> dict[int, float]:
    """Train in this process (one rank); the losses by step."""
    return pretrain(parse_config([*QUIET, *args])).losses


def _on_rank(rank: int, world_size: int, runs: list[list[str]]) -> list[dict[int, float]]:
    """Each run's losses as this rank sees them (the last rank knows them all): runs one after
    another in the process group run_ranks formed, as torchrun ranks would."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    return [pretrain(parse_config([*QUIET, *args])).losses for args in runs]


def _spawn(world_size: int, runs: list[list[str]]) -> list[dict[int, float]]:
    return run_ranks(world_size, _on_rank, runs)[-1]


# ---------------------------------------------------------------------------------------------
# 1. Resharding on load

LLAMA = ["--model.family=llama", "--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8",
         "--model.num_query_groups=4", "--model.seq_length=32", "--model.vocab_size=250", "--train.micro_batch_size=1",
         "--train.global_batch_size=8", "--train.train_iters=7", "--optim.clip_grad=0.5", "--parallel.bucket_size=5000"]
SAVED_AT = ["--parallel.tp=2", "--parallel.pp=2", "--parallel.vp=2", "--parallel.sequence_parallel=true",
            "--parallel.distributed_optimizer=true"]
RESUME_AT = {
    "tp1-pp4-dp2": ["--parallel.pp=4", "--parallel.distributed_optimizer=true"],
    "tp4-pp1-dp2": ["--parallel.tp=4"],
}


def test_checkpoint_resumes_at_every_layout(tmp_path):
    """Train 7 steps at tp2 x pp2 (vp2) x dp2 with the distributed optimizer, saving at step 4; from
    that checkpoint, steps 5-7 at other layouts equal the uninterrupted one-device run (fp32,
    rel 1e-5), and at the same layout they equal the uninterrupted run bit for bit."""
    ckpt = tmp_path / "ckpt"
    step4 = [f"--checkpoint.load={ckpt / 'iter_0000004'}"]
    saved, same, *elsewhere = _spawn(8, [
        [*LLAMA, *SAVED_AT, f"--checkpoint.save={ckpt}", "--checkpoint.save_interval=4"],
        [*LLAMA, *SAVED_AT, *step4],
        *[[*LLAMA, *layout, *step4] for layout in RESUME_AT.values()],
    ])
    one_device = _losses(LLAMA)
    alone = _losses([*LLAMA, *step4])
    assert sorted(saved) == list(range(1, 8)) and (ckpt / "iter_0000004").is_dir()
    assert list(saved.values()) == pytest.approx(list(one_device.values()), rel=1e-5)
    assert same == {s: saved[s] for s in (5, 6, 7)}
    for name, losses in [*zip(RESUME_AT, elsewhere), ("tp1-pp1-dp1", alone)]:
        assert sorted(losses) == [5, 6, 7], name
        assert [losses[s] for s in (5, 6, 7)] == pytest.approx([one_device[s] for s in (5, 6, 7)], rel=1e-5), name


# ---------------------------------------------------------------------------------------------
# Torchrun jobs the test kills, stops or signals

# The tests act on a job held after a known step (tests/held_pretrain.py), so what they do lands
# there whatever the machine's speed.
STEPS = 12
SLOW = ["--model.num_layers=4", "--model.hidden_size=128", "--model.num_attention_heads=4", "--model.seq_length=128",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.global_batch_size=4",
        f"--train.train_iters={STEPS}"]


@pytest.fixture(scope="module")
def slow_reference() -> dict[int, float]:
    """The uninterrupted run, in one process."""
    return _losses(SLOW)


def _job(tmp: Path, nproc: int, args: list[str], *launcher: str, hold_after: int) -> Job:
    """pretrain_gpt.py under torchrun with this file's quiet arguments, held after step `hold_after`."""
    return Job(tmp, nproc, [*QUIET, *args], *launcher, hold_after=hold_after)


# ---------------------------------------------------------------------------------------------
# 2. A worker killed mid-run: torchrun restarts the job, which resumes from the latest checkpoint


def test_killed_worker_restarts_and_finishes_like_an_uninterrupted_run(tmp_path, slow_reference):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    job = _job(tmp_path, 2, [*SLOW, f"--checkpoint.save={ckpt}", "--checkpoint.save_interval=2",
                            f"--logging.metrics_file={metrics}"],
              "--max-restarts=1", hold_after=3)
    job.wait_until_held()  # step 2's checkpoint is published, step 3 logged
    job.workers()[0].kill()  # SIGKILL; rank 0, so the logging rank (1) never dies mid-line
    job.release()  # the restarted workers do not hold again
    out = job.finish()
    assert job.proc.returncode == 0, out[-3000:]
    resumed = [line for line in out.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1, out[-3000:]
    at = int(resumed[0].split(" at step ")[1].split()[0])
    assert resumed[0].startswith(f"resumed from {ckpt / f'iter_{at:07d}'} ") and at >= 2
    records = read_metrics(metrics)
    first, second = records[: len(records) - (STEPS - at)], records[len(records) - (STEPS - at):]
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= at, "first attempt"
    assert len(first) < STEPS, "the kill must land before the end"
    assert [r["step"] for r in second] == list(range(at + 1, STEPS + 1)), "second attempt"
    assert second[-1]["loss"] == pytest.approx(slow_reference[STEPS], rel=1e-5)
    assert [r["loss"] for r in records] == pytest.approx([slow_reference[r["step"]] for r in records], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# 3. A hanging rank: the others fail after parallel.timeout_minutes with megalite's message


def test_a_hanging_rank_makes_the_others_fail_after_the_timeout(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    job = _job(tmp_path, 2, [*SLOW, "--train.train_iters=1000", "--parallel.timeout_minutes=0.2",
                            f"--logging.metrics_file={metrics}"], hold_after=2)
    job.wait_until_held()
    workers = job.workers()
    workers[1].suspend()  # SIGSTOP: alive, its sockets open, but it never joins another collective
    job.release()
    try:
        gone, _ = psutil.wait_procs([workers[0]], timeout=240)
        assert gone, f"rank 0 still waits on the stopped rank:\n{job.output()[-3000:]}"
    finally:
        workers[1].kill()
    out = job.finish()
    assert job.proc.returncode != 0
    assert ("rank 0: a collective timed out after parallel.timeout_minutes=0.2; another rank died or hangs"
            in out), out[-3000:]


# ---------------------------------------------------------------------------------------------
# 4. SIGKILL in the middle of a save leaves the previous checkpoint current

SMALL = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
         "--model.vocab_size=300", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=6"]

# Runs pretrain_gpt.py in this process after wrapping one function of megalite.checkpoint.files so
# that its second call SIGKILLs the process: `listing` when rank 0 is about to write its
# rank_00000.json (its safetensors file is written), `publish` in finalize once index.json is
# written, before the directory is renamed and `latest` rewritten.
_KILL_ON_SECOND_SAVE = """
import os, runpy, signal, sys
import megalite.checkpoint.files as files

where = sys.argv.pop(1)
name = {"listing": "atomic_write_text", "publish": "fsync_tree"}[where]
original, calls = getattr(files, name), []

def dying(path, *args):
    if where == "publish" or path.name.startswith("rank_"):
        calls.append(path)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return original(path, *args)

setattr(files, name, dying)
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def small_reference() -> dict[int, float]:
    return _losses(SMALL)


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("where", ["listing", "publish"])
def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path, small_reference, where, async_save):
    """Saves at steps 2, 4, 6; the process dies inside the save of step 4. The next run resumes
    from step 2, bit-exactly, and its first save removes the dead save's directory."""
    ckpt = tmp_path / "ckpt"
    args = [*SMALL, f"--checkpoint.save={ckpt}", "--checkpoint.save_interval=2",
            f"--checkpoint.async_save={str(async_save).lower()}"]
    died = subprocess.run([sys.executable, "-c", _KILL_ON_SECOND_SAVE, where, *QUIET, *args], check=False, cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "2"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004.tmp"]
    assert problem_with(ckpt / "iter_0000002") is None
    stale = ckpt / "iter_0000004.tmp"
    assert (stale / "rank_00000.safetensors").is_file()  # killed after the shard was written
    assert (stale / "index.json").is_file() == (where == "publish")

    resumed = _losses(args)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert resumed == {s: small_reference[s] for s in resumed}  # same layout: bit-exact
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert (ckpt / "latest").read_text().strip() == "6"


# ---------------------------------------------------------------------------------------------
# 5. Asynchronous saves write what synchronous ones write


def _iteration_files(root: Path) -> dict[str, object]:
    """Every file of every checkpoint under root: tensors by value, the rest by text (the config's
    checkpoint.save and async_save aside)."""
    found = {}
    for file in sorted(root.rglob("*")):
        if not file.is_file():
            continue
        name = str(file.relative_to(root))
        if file.suffix == ".safetensors":
            found[name] = load_file(file)
        elif file.suffix == ".pt":
            found[name] = torch.load(file, weights_only=True)  # the zip also holds a random serialization id
        else:
            found[name] = file.read_text().replace(str(root), "ROOT").replace("async_save: true", "async_save: false")
    return found


def test_async_save_writes_the_same_checkpoints_and_resumes_bit_exactly(tmp_path):
    """Two data-parallel ranks with the distributed optimizer, so each writes its own slices."""
    layout = [*SMALL, "--parallel.distributed_optimizer=true"]
    sync, async_, resumed = _spawn(2, [
        [*layout, f"--checkpoint.save={tmp_path / 'sync'}", "--checkpoint.save_interval=2"],
        [*layout, f"--checkpoint.save={tmp_path / 'async'}", "--checkpoint.save_interval=2",
         "--checkpoint.async_save=true"],
        [*layout, f"--checkpoint.load={tmp_path / 'async' / 'iter_0000002'}"],
    ])
    assert async_ == sync and sorted(sync) == list(range(1, 7))
    assert resumed == {s: sync[s] for s in (3, 4, 5, 6)}
    written, expected = _iteration_files(tmp_path / "async"), _iteration_files(tmp_path / "sync")
    assert sorted(written) == sorted(expected) and "iter_0000006/rank_00001.safetensors" in written
    for name, value in expected.items():
        if isinstance(value, dict):
            assert value.keys() == written[name].keys(), name
            assert all(torch.equal(value[k], written[name][k]) for k in value), name
        else:
            assert written[name] == value, name
