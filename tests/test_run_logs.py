"""What a run writes for a reader of its log file: every log line's step of the total, pace, elapsed time and
ETA; the start-up summary (the resolved config, the whole model's and each rank's parameters, the planner's
memory against the GPU's); the end-of-run summary; and checkpoints that keep the config as given beside its
resolved view."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from wandb_records import read_run

from megalite.checkpoint.hf_convert import megalite_to_hf
from megalite.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from megalite.config_cli import config_from_yaml_text, parse_config
from megalite.planning.memory import memory_per_stage
from megalite.planning.parameters import model_parameters, rank_parameters
from megalite.training.metrics import format_duration
from megalite.training.pretrain import pretrain
from megalite.training.run_summary import gpu_memory_line, memory_line, parameters_line

NUMBER = r"[\d.e+-]+"


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One 4-step run that logs every 2 steps, evaluates at the end and saves: (result, stdout, directory)."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = tiny_config(train={"eval_interval": 4, "eval_iters": 1},
                      logging={"metrics_file": str(tmp / "metrics.jsonl"), "log_interval": 2},
                      checkpoint={"save": str(tmp / "ckpt")})
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = pretrain(cfg)
    return result, out.getvalue(), tmp


def test_every_log_line_says_step_of_total_pace_elapsed_and_eta(logged_run):
    _, out, tmp = logged_run
    lines = [line for line in out.splitlines() if line.startswith("step ") and "| loss " in line]
    assert [line.split(" |")[0] for line in lines] == ["step 2/4", "step 4/4"]
    for line in lines:
        assert re.search(rf"\| s/step {NUMBER} \| elapsed {NUMBER}s \| ETA {NUMBER}s$", line), line
    assert lines[-1].endswith("| ETA 0.0s")
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert all(r["s_per_step"] > 0 and r["elapsed_s"] > 0 for r in steps)
    assert steps[0]["eta_s"] == pytest.approx(2 * steps[0]["s_per_step"]) and steps[-1]["eta_s"] == 0
    assert "step 4/4 | validation loss" in out


def test_the_run_ends_with_a_summary_of_steps_tokens_time_losses_and_outputs(logged_run):
    result, out, tmp = logged_run
    summary = out[out.index("run summary:"):].splitlines()
    assert re.fullmatch(rf"run summary: 4 steps to step 4/4, 512 tokens in {NUMBER}s, {NUMBER} s/step, "
                        r"[\d,]+ tokens/s", summary[0]), summary[0]
    assert summary[1] == f"  final train loss {result.losses[4]:.4f}, validation loss {result.val_loss:.4f}"
    assert summary[2:] == [f"  checkpoint {tmp / 'ckpt' / 'iter_0000004'} (the same command resumes from it)",
                           f"  metrics    {tmp / 'metrics.jsonl'}"]


def test_the_start_up_dump_shows_the_derived_fields_resolved(logged_run):
    _, out, _ = logged_run
    dump = out[out.index("megalite config (resolved"):out.index("world 1")]
    assert "  ffn_hidden_size: 256\n" in dump and "  activation: gelu_tanh\n" in dump and "null\n  bias" not in dump
    assert "  num_query_groups: 4\n" in dump and "  zero_stage: 0\n" in dump
    assert f"parameters: {model_parameters(tiny_config().model) / 1e6:.2f}M in the model" in out


def test_a_checkpoint_keeps_the_config_as_given_and_its_resolved_view(logged_run):
    """config.yaml reused with a new hidden size derives a new MLP width; resolved.yaml shows the one used;
    the tools that read a checkpoint's config (conversion, generation) still read it."""
    _, _, tmp = logged_run
    iteration = tmp / "ckpt" / "iter_0000004"
    given = (iteration / "config.yaml").read_text()
    assert "  ffn_hidden_size: null\n" in given and "  activation: null\n" in given
    assert "  ffn_hidden_size: 256\n" in (iteration / "resolved.yaml").read_text()
    reused = parse_config(["--config", str(iteration / "config.yaml"), "--model.hidden_size=128"])
    assert reused.model.ffn_size == 512
    cfg, tensors = read_model_tensors(tmp / "ckpt")
    assert cfg == config_from_yaml_text(given, "config.yaml") and cfg.model.ffn_hidden_size is None
    assert sum(t.numel() for t in tensors.values()) == model_parameters(cfg.model)


def test_the_parameter_count_is_the_whole_models_at_any_layout():
    one = parse_config(["--model.num_layers=4"])
    total = f"parameters: {model_parameters(one.model) / 1e6:.2f}M in the model"
    tp = parse_config(["--model.num_layers=4", "--parallel.tp=2"])
    pp = parse_config(["--model.num_layers=4", "--parallel.pp=2"])
    assert parameters_line(one).startswith(total) and parameters_line(one).endswith(
        f"per rank: {rank_parameters(one, 0).total / 1e6:.2f}M")
    assert parameters_line(tp).startswith(total) and parameters_line(tp).endswith(
        f"per rank (tp 2): {rank_parameters(tp, 0).total / 1e6:.2f}M")
    assert parameters_line(pp).startswith(total) and parameters_line(pp).endswith(
        f"per rank (pp 2): {rank_parameters(pp, 0).total / 1e6:.2f}M (stage 0), "
        f"{rank_parameters(pp, 1).total / 1e6:.2f}M (stage 1)")
    moe = parse_config(["--model.family=llama", "--model.num_experts=4", "--parallel.ep=2", "--parallel.zero_stage=3"])
    assert " active per token) " in parameters_line(moe) and "per rank (ep 2): " in parameters_line(moe)
    assert parameters_line(moe).endswith("; ZeRO-3 keeps 1/dp of them between uses")


def test_the_memory_estimate_is_the_planners_against_the_gpus_memory():
    cfg = parse_config(["--model.num_layers=4", "--parallel.pp=2"])
    worst = max(memory_per_stage(cfg, 2, "cuda"), key=lambda s: s.total)
    line = memory_line(cfg, 2, "NVIDIA H100 80GB HBM3", 80 * 2**30)
    assert line == (f"memory (planner): {worst.total / 2**30:.1f} GiB per GPU (pipeline stage {worst.pp_rank}) "
                    f"of 80.0 GiB on NVIDIA H100 80GB HBM3 ({worst.total / (80 * 2**30):.0%})")
    assert memory_line(cfg, 2, "a small GPU", 2**20).endswith(
        "; it does not fit: see `python tools/plan.py --config ...` for layouts that do")


def test_durations_read_at_a_glance():
    assert [format_duration(s) for s in (0.04, 59.94, 65, 3723.4)] == ["0.0s", "59.9s", "1m05s", "1h02m03s"]


def test_after_a_resume_the_metrics_file_continues_at_the_resumed_step(tmp_path, capsys):
    """A run killed after step 5 but whose last checkpoint is step 3 (and whose last line the kill cut short):
    resumed, the file holds every step once."""
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    cfg = tiny_config(train={"train_iters": 5}, logging={"metrics_file": str(metrics)},
                      checkpoint={"save": str(ckpt), "save_interval": 3})
    pretrain(cfg)
    shutil.rmtree(ckpt / "iter_0000005")
    (ckpt / "latest").write_text("3\n")
    with metrics.open("a") as f:
        f.write('{"step": 6, "loss"')
    pretrain(cfg)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert (f"metrics file {metrics}: dropped 3 records after step 3, written by a run that got further than its "
            "last checkpoint; this run writes those steps again") in capsys.readouterr().out


def test_a_resumed_offline_wandb_run_keeps_one_directory_with_the_whole_history(tmp_path, capsys):
    """The first part logs steps 1-4 but its last checkpoint is step 2 (killed before saving step 4): the resumed
    part's directory holds steps 1-2 of the first and its own 3-4; the first part's directory is gone."""
    ckpt = tmp_path / "ckpt"
    cfg = tiny_config(checkpoint={"save": str(ckpt), "save_interval": 2},
                      logging={"wandb_project": "megalite-test", "wandb_mode": "offline", "wandb_dir": str(tmp_path)})
    first = pretrain(cfg)
    shutil.rmtree(ckpt / "iter_0000004")
    (ckpt / "latest").write_text("2\n")
    second = pretrain(cfg)
    (directory,) = (tmp_path / "wandb").glob("offline-run-*")
    assert first.wandb_run_id == second.wandb_run_id and str(directory) == str(Path(second.wandb_dir).parent)
    run = read_run(directory)
    assert run["config"]["model"]["ffn_hidden_size"] == 256  # W&B gets the resolved config, to compare runs by
    logged = {r["_step"]: r["loss"] for r in run["history"]}
    assert logged == pytest.approx({1: first.losses[1], 2: first.losses[2], 3: second.losses[3], 4: second.losses[4]})
    assert f"W&B: {directory} holds the whole run; removed the 1 offline directory of its earlier parts" in (
        capsys.readouterr().out)


def test_checkpoint_and_hf_weights_are_readable_as_the_umask_says(logged_run, tmp_path):
    """safetensors 0.8 writes 0600; a team sharing a file system reads what the umask lets it."""
    cfg, tensors = read_model_tensors(logged_run[2] / "ckpt")
    previous = os.umask(0o007)
    try:
        iteration = write_model_checkpoint(tmp_path / "ckpt", cfg, tensors)
        megalite_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(previous)
    files = [iteration / "rank_00000.safetensors", *(tmp_path / "hf").glob("*.safetensors")]
    assert len(files) == 2 and [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o660, 0o660]


def test_the_memory_line_is_printed_for_a_gpu_only_and_never_stops_a_run(monkeypatch):
    cfg = parse_config([])
    assert gpu_memory_line(cfg, 1, torch.device("cpu")) is None
    monkeypatch.setattr("megalite.training.run_summary.device_memory", lambda device: ("NVIDIA H100", 80 * 2**30))
    assert gpu_memory_line(cfg, 1, torch.device("cuda", 0)) == memory_line(cfg, 1, "NVIDIA H100", 80 * 2**30)

    def broken(*args):
        raise KeyError("a planner bug")

    monkeypatch.setattr("megalite.training.run_summary.memory_per_stage", broken)
    assert gpu_memory_line(cfg, 1, torch.device("cuda", 0)) == "memory (planner): n/a (KeyError: 'a planner bug')"
