"""Preemption saves, however the cluster sends it (issue 34), with the default data workers (2 per rank):

- SIGTERM to the launcher (torchrun forwards it to each rank's process group), to every process of the job
  at once (what Slurm does to a job step) and to one rank: every rank stops after the step that follows the
  signal, saves (asynchronously, at pp 2), exits 0 with one line saying where and that the same command
  resumes; three such stops in a row, each run resumed by the same command, give the uninterrupted losses;
- Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) saves the same way in two lines
  and leaves a finished W&B run with every step; a second Ctrl-C during the save aborts with one line and
  status 130, publishes nothing and leaves no process behind;
- the ranks agree on a stop at every step, not only at log steps (spawned ranks, one of them signalled);
- a stop with no checkpoint.save to save into says so and exits 143, as a process the signal ended.

Jobs are held after a known step (tests/held_pretrain.py) while the test signals them, so every stop lands
at a step known in advance. The Slurm script's side (requeue only after a save, a save longer than
torchrun's default grace) is in tests/test_launch_scripts.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import tiny_config
from distributed import metrics as read_metrics
from distributed import run_ranks
from held_job import LAUNCH, ROOT, Job
from wandb_records import read_run

from megalite.config_cli import parse_config
from megalite.training.pretrain import pretrain

STEPS = 12
TINY = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
        "--model.vocab_size=300", "--train.micro_batch_size=1", "--train.global_batch_size=4",
        f"--train.train_iters={STEPS}", "--data.mock=true", "--train.device=cpu", "--logging.progress_bar=false",
        "--logging.log_interval=1"]
GRACE = "--shutdown-timeout=120"  # torchrun's wait for the ranks to save and exit


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    """The uninterrupted run, in one process."""
    return pretrain(parse_config([*TINY, "--data.num_workers=0"])).losses


def _resumed(ckpt: Path) -> dict[int, float]:
    """The rest of the run from the latest checkpoint, in one process."""
    return pretrain(parse_config([*TINY, "--data.num_workers=0", f"--checkpoint.load={ckpt}"])).losses


def _saved_line(name: str, step: int, ckpt: Path) -> str:
    return (f"{name} received: stopped after step {step} and saved {ckpt / f'iter_{step:07d}'}; "
            "run the same command to resume from it")


def _to_every_process(job: Job) -> None:
    for process in job.processes():
        process.send_signal(signal.SIGTERM)


SIGTERM_WAYS = {  # how each stop is sent, and after which step of its run the job is held for it
    "to the launcher": (lambda job: job.proc.send_signal(signal.SIGTERM), 2),
    "to every process": (_to_every_process, 2),
    "to one rank": (lambda job: job.workers()[0].send_signal(signal.SIGTERM), 1),
}


def test_sigterm_every_way_saves_and_the_same_command_resumes(tmp_path, reference):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    command = [*TINY, "--parallel.pp=2", f"--checkpoint.save={ckpt}", "--checkpoint.async_save=true",
               f"--logging.metrics_file={metrics}"]
    start = 0
    for way, (send, hold) in SIGTERM_WAYS.items():
        job = Job(tmp_path, 2, command, GRACE, hold_after=hold, command=LAUNCH)
        job.wait_until_held()  # after step start + hold
        send(job)
        job.release()
        out = job.finish()
        stopped = start + hold + 2  # the next step queues the vote, the one after reads it
        assert job.proc.returncode == 0, f"{way}:\n{out[-3000:]}"
        assert out.count("SIGTERM received") == 1 and _saved_line("SIGTERM", stopped, ckpt) in out, f"{way}:\n{out}"
        assert "Traceback" not in out, f"{way}:\n{out[-3000:]}"
        assert (ckpt / "latest").read_text().strip() == str(stopped), way
        assert start == 0 or f"resumed from {ckpt / f'iter_{start:07d}'} at step {start}" in out, way
        start = stopped
    rest = _resumed(ckpt)
    assert sorted(rest) == list(range(start + 1, STEPS + 1))
    losses = {r["step"]: r["loss"] for r in read_metrics(metrics)} | rest
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert list(losses.values()) == pytest.approx([reference[s] for s in losses], rel=1e-5)


def test_ctrl_c_saves_in_two_lines_and_a_second_one_aborts(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    command = [*TINY, "--parallel.distributed_optimizer=true", f"--checkpoint.save={ckpt}",
               "--logging.wandb_project=megalite-test", "--logging.wandb_mode=offline",
               "--logging.wandb_timeout=300"]
    job = Job(tmp_path, 2, command, GRACE, hold_after=2, command=LAUNCH, session=True)
    job.wait_until_held()
    before = len(job.output())
    os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
    job.release()
    out = job.finish()
    assert job.proc.returncode == 0, out[-3000:]
    said, summary = out[before:].split("run summary: ", 1)  # the end-of-run summary every run ends with
    said = [line for line in said.splitlines() if not line.startswith("step ")]
    assert said == [f"saved checkpoint {ckpt / 'iter_0000004'}", _saved_line("SIGINT", 4, ckpt)], out[before:]
    assert summary.startswith("4 steps to step 4/12") and "Traceback" not in summary, summary
    (run,) = (ckpt / "wandb").glob("offline-run-*")  # W&B never fell back to another run
    assert [r["_step"] for r in read_run(run)["history"]] == [1, 2, 3, 4]
    assert read_run(run)["exit_code"] == 0

    job = Job(tmp_path, 2, command, GRACE, hold_after=1, command=LAUNCH, session=True, env={"HOLD_SAVE": "wait"})
    job.wait_until_held()  # after step 5
    os.killpg(job.proc.pid, signal.SIGINT)
    job.release()
    job.wait_for_files("saving")  # every rank is writing step 7's checkpoint
    processes = job.processes()
    before = len(job.output())
    os.killpg(job.proc.pid, signal.SIGINT)
    out = job.finish()
    assert job.proc.returncode == 130, out[-3000:]
    said = out[before:].splitlines()
    assert "interrupted again: aborted without saving; the last complete checkpoint is unchanged" in said
    assert len(said) <= 3 and "Traceback" not in out and "KeyboardInterrupt" not in out, out[before:]
    assert (ckpt / "latest").read_text().strip() == "4" and not (ckpt / "iter_0000007").exists()
    _, alive = psutil.wait_procs(processes, timeout=120)  # data workers and W&B follow their rank
    assert not alive, alive
    rest = _resumed(ckpt)
    assert list(rest.values()) == pytest.approx([reference[s] for s in range(5, STEPS + 1)], rel=1e-5)


def _one_rank_signalled(rank: int, world_size: int, root: str) -> tuple[int, str, str]:
    """Rank 1 receives SIGTERM during step 3 (log steps every 10): what each rank's run did."""
    from megalite.training import pretrain as pretrain_module

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    step, started = pretrain_module.train_step, [0]

    def step_signalling_rank_1(trainer, batches):
        started[0] += 1
        if started[0] == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(trainer, batches)

    pretrain_module.train_step = step_signalling_rank_1
    result = pretrain_module.pretrain(tiny_config(train={"train_iters": 8}, logging={"log_interval": 10},
                                                  checkpoint={"save": root}))
    return result.final_step, result.stopped_by.name, result.checkpoint.name


def test_the_ranks_agree_on_a_stop_at_every_step(tmp_path):
    """Not only at log steps: the vote queued at the end of step 3 carries rank 1's signal, step 4 reads it."""
    assert run_ranks(2, _one_rank_signalled, str(tmp_path)) == [(4, "SIGTERM", "iter_0000004")] * 2
    assert (tmp_path / "latest").read_text().strip() == "4"


# Runs pretrain_gpt.py in this process after wrapping train_step so that the process sends itself SIGTERM
# during step 2 (as a scheduler would, to one process).
_SIGTERM_IN_STEP_2 = """
import os, runpy, signal, sys
import megalite.training.pretrain as pretrain_module

step, started = pretrain_module.train_step, [0]

def signalled_step(trainer, batches):
    started[0] += 1
    if started[0] == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return step(trainer, batches)

pretrain_module.train_step = signalled_step
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_a_stop_without_checkpoint_save_says_so_and_exits_like_the_signal(tmp_path):
    """Nothing saved is work lost: exit status 143 (128 + SIGTERM), as a process the signal ended, with the line
    saying what to set; no traceback."""
    done = subprocess.run([sys.executable, "-c", _SIGTERM_IN_STEP_2, *TINY, "--data.num_workers=0"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert ("SIGTERM received: stopped after step 3 without saving (set checkpoint.save to resume after a "
            "preemption)") in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
