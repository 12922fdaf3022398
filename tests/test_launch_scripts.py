"""The cluster launch scripts, run for real on this machine: two "nodes" on loopback train together
to the same losses as one 4-process node, and the Slurm script requeues the job when warned of
its time limit (srun and scontrol stand-ins run the step locally)."""

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


FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun on one node: drop srun's options, run the command.
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# Stand-in for scontrol: the node list is this machine; a requeue is written down.
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""


def _wait_for_first_step(metrics: Path, job: subprocess.Popen) -> None:
    while not (metrics.exists() and read_metrics(metrics)):
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.2)


def test_slurm_script_requeues_when_warned_of_the_time_limit(tmp_path):
    """USR1 (sent by --signal=B:USR1@300) makes the script stop the ranks with SIGTERM and requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "scontrol.log"
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID="4242",
               SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node0", MASTER_PORT=str(free_port()), NPROC_PER_NODE="2",
               SCONTROL_LOG=str(log))
    job = subprocess.Popen(["bash", str(SCRIPTS / "slurm/pretrain.sbatch"), str(_config(tmp_path)),
                            "--train.train_iters=100000", f"--logging.metrics_file={metrics}"],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    _wait_for_first_step(metrics, job)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-3000:]
    assert log.read_text() == "requeue 4242\n"
    assert "time limit near" in out
    assert read_metrics(metrics)[-1]["step"] < 100000
