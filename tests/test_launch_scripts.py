"""The cluster launch scripts, run for real on this machine: two "nodes" on loopback train together
to the same losses as one 4-process node, and the Slurm script requeues a job warned of its time
limit only once its ranks saved (srun and scontrol stand-ins run the step locally)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from distributed import metrics as read_metrics

from megalite.parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TINY = {
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 300},
    "train": {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": 3, "device": "cpu"},
    "data": {"mock": True},
    "logging": {"log_interval": 1, "progress_bar": False},
}


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "RDZV_ID", "NPROC", "NPROC_PER_NODE")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **extra}


def _run(script: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPTS / script), *map(str, args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out[-3000:]
    return out


def test_two_nodes_on_loopback_equal_one_node(tmp_path):
    """Static rendezvous (NODE_RANK); the Slurm test below runs the c10d one (RDZV_ID)."""
    config = _config(tmp_path)
    _finish(_run("train_single_node.sh", [config, f"--logging.metrics_file={tmp_path / 'one.jsonl'}"], _env(NPROC="4")))
    common = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NPROC_PER_NODE": "2"}
    args = [config, f"--logging.metrics_file={tmp_path / 'two.jsonl'}"]
    nodes = [_run("train_multi_node.sh", args, _env(**common, NODE_RANK=str(k))) for k in range(2)]
    outputs = [_finish(node) for node in nodes]
    assert "world 4 (tp 1, pp 1, dp 4)" in "".join(outputs)
    one, two = read_metrics(tmp_path / "one.jsonl"), read_metrics(tmp_path / "two.jsonl")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("env,message", [
    ({}, "set NNODES"),
    ({"NNODES": "2"}, "set MASTER_ADDR"),
    ({"NNODES": "2", "MASTER_ADDR": "127.0.0.1"}, "set NODE_RANK"),
])
def test_multi_node_script_names_what_is_missing(tmp_path, env, message):
    done = subprocess.run(["bash", str(SCRIPTS / "train_multi_node.sh"), str(_config(tmp_path))], env=_env(**env),
                          capture_output=True, text=True)
    assert done.returncode != 0 and message in done.stderr


@pytest.mark.parametrize("script", ["train_single_node.sh", "train_multi_node.sh"])
def test_scripts_need_an_existing_config(script):
    done = subprocess.run(["bash", str(SCRIPTS / script), "nowhere.yaml"], env=_env(), capture_output=True, text=True)
    assert done.returncode == 2 and "config file 'nowhere.yaml' not found" in done.stderr


@pytest.mark.parametrize("script",
                         ["train_single_node.sh", "train_multi_node.sh", "lib_launch.sh", "slurm/pretrain.sbatch"])
def test_script_syntax(script):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


FAKE_SRUN = """#!{python}
# Stand-in for srun on one node: drop srun's options, run the command; a signal srun receives goes to every
# process of the step at once (launcher, ranks, data workers, W&B), as slurmstepd sends it.
import signal, subprocess, sys
import psutil

args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
step = subprocess.Popen(args)


def forward(signum, frame):
    root = psutil.Process(step.pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            process.send_signal(signum)
        except psutil.Error:
            pass


for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, forward)
code = step.wait()
sys.exit(code if code >= 0 else 128 - code)
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# Stand-in for scontrol: the node list is this machine; a requeue is written down.
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""
STEPS = 8
SAVED = {**TINY, "train": {**TINY["train"], "train_iters": STEPS}}


def _slurm_submission(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A submit directory whose scripts are the repository's and whose pretrain_gpt.py runs it held after a
    known step (tests/held_pretrain.py), and the environment Slurm would give the batch script."""
    submit, bin_dir = tmp_path / "submit", tmp_path / "bin"
    submit.mkdir()
    bin_dir.mkdir()
    (submit / "scripts").symlink_to(SCRIPTS)
    (submit / "pretrain_gpt.py").write_text(
        f"import runpy, sys\nsys.argv[0] = {str(ROOT / 'tests' / 'held_pretrain.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "holds").mkdir()
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(submit), SLURM_JOB_ID="4242",
               SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node0", MASTER_PORT=str(free_port()), NPROC_PER_NODE="2",
               SCONTROL_LOG=str(tmp_path / "scontrol.log"), HOLD_DIR=str(tmp_path / "holds"), TMPDIR=str(tmp_path))
    return submit, env


def _warn_of_time_limit(tmp_path: Path, submit: Path, env: dict[str, str], args: list[str]) -> tuple[int, str]:
    """Submit, wait until both ranks are held, send the batch script USR1 (--signal=B:USR1@300), release."""
    holds = tmp_path / "holds"
    for stale in holds.iterdir():
        stale.unlink()
    job = subprocess.Popen(["bash", str(submit / "scripts" / "slurm" / "pretrain.sbatch"), *args], env=env,
                           cwd=submit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not all((holds / f"held_{rank}").exists() for rank in range(2)):
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)
    (holds / "go").touch()
    out, _ = job.communicate(timeout=600)
    return job.returncode, out


def test_slurm_script_requeues_only_a_job_that_saved(tmp_path):
    """Warned of its time limit, the script stops the ranks with SIGTERM to every process of the step. The
    ranks save at the step after next in 31 s, longer than torchrun's default 30 s grace (the scripts give
    180), and the job is requeued; the requeued job continues from there, and when its save fails it is not
    requeued and ends with an error status. Resumed, the run has the uninterrupted losses."""
    config, ckpt = _config(tmp_path), tmp_path / "ckpt"
    config.write_text(yaml.safe_dump(SAVED))
    submit, env = _slurm_submission(tmp_path)
    args = [str(config), f"--checkpoint.save={ckpt}"]
    code, out = _warn_of_time_limit(tmp_path, submit, {**env, "HOLD_AFTER_STEP": "2", "HOLD_SAVE": "31"}, args)
    assert code == 0, out[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "time limit near" in out and "SIGTERM received: stopped after step 4 and saved" in out
    assert (ckpt / "latest").read_text().strip() == "4"

    requeued = {**env, "SLURM_RESTART_COUNT": "1", "HOLD_AFTER_STEP": "1", "HOLD_SAVE": "fail"}
    code, out = _warn_of_time_limit(tmp_path, submit, requeued, args)
    assert code != 0 and "the ranks did not save" in out, out[-3000:]
    assert f"resumed from {ckpt / 'iter_0000004'} at step 4" in out
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # not again
    assert (ckpt / "latest").read_text().strip() == "4"

    from megalite.config_cli import parse_config
    from megalite.training.pretrain import pretrain

    uninterrupted = pretrain(parse_config(["--config", str(config), "--data.num_workers=0"])).losses
    resumed = pretrain(parse_config(["--config", str(config), "--data.num_workers=0",
                                     f"--checkpoint.load={ckpt}"])).losses
    assert list(resumed.values()) == pytest.approx([uninterrupted[s] for s in range(5, STEPS + 1)], rel=1e-5)
