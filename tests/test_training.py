"""End-to-end single-process training: learning, exact resume, precision, recompute,
gradient accumulation, and what reaches the metrics file and W&B."""

from __future__ import annotations

import json
import math

import pytest
from conftest import tiny_config
from wandb_records import read_run

from megalite.training.pretrain import pretrain


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loss_decreases(family):
    cfg = tiny_config(family, train={"train_iters": 40, "global_batch_size": 8}, optim={"lr": 3e-3, "warmup_iters": 4})
    losses = list(pretrain(cfg).losses.values())
    assert len(losses) == 40 and all(math.isfinite(l) for l in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


def test_resume_gives_identical_losses(tmp_path):
    straight = pretrain(tiny_config(train={"train_iters": 6})).losses
    ckpt = str(tmp_path / "ckpt")
    first = pretrain(tiny_config(train={"train_iters": 6, "exit_interval": 3}, checkpoint={"save": ckpt, "load": ckpt}))
    assert first.final_step == 3 and (tmp_path / "ckpt" / "iter_0000003" / "rank_00000.safetensors").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "3"
    second = pretrain(tiny_config(train={"train_iters": 6}, checkpoint={"save": ckpt, "load": ckpt}))
    assert {**first.losses, **second.losses} == straight
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "6"


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_does_not_change_the_numbers(mode):
    baseline = pretrain(tiny_config("llama")).losses
    assert pretrain(tiny_config("llama", train={"recompute": mode})).losses == pytest.approx(baseline, abs=1e-6)


def test_gradient_accumulation_matches_one_big_micro_batch():
    accumulated = pretrain(tiny_config(train={"micro_batch_size": 1, "global_batch_size": 4})).losses
    single = pretrain(tiny_config(train={"micro_batch_size": 4, "global_batch_size": 4})).losses
    assert accumulated == pytest.approx(single, abs=1e-5)


def test_bf16_trains():
    losses = pretrain(tiny_config(train={"precision": "bf16", "train_iters": 3})).losses
    fp32 = pretrain(tiny_config(train={"train_iters": 3})).losses
    assert losses == pytest.approx(fp32, abs=0.05)


def test_fp16_overflow_skips_steps_until_the_scale_fits(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cfg = tiny_config(
        train={"precision": "fp16", "train_iters": 30},
        optim={"initial_loss_scale": 2.0**40, "hysteresis": 1},
        logging={"metrics_file": str(metrics)},
    )
    pretrain(cfg)
    records = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert (records[0]["skipped_steps"] == 1 and records[0]["loss_scale"] == 2.0**39
            and math.isnan(records[0]["grad_norm"]))
    skipped = records[-1]["skipped_steps"]
    assert 1 <= skipped < 30 and records[-1]["loss_scale"] == 2.0 ** (40 - skipped)
    assert all(math.isfinite(r["grad_norm"]) for r in records[skipped:])


def test_metrics_file_holds_one_object_per_logged_step(tmp_path):
    metrics = tmp_path / "m" / "metrics.jsonl"
    result = pretrain(tiny_config(train={"train_iters": 6, "eval_interval": 3, "eval_iters": 1},
                                  logging={"metrics_file": str(metrics), "log_interval": 2}))
    records = [json.loads(l) for l in metrics.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    for r in steps:
        assert r["loss"] == result.losses[r["step"]]
        assert {"lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu", "peak_memory_gib"} <= r.keys()
        assert r["tokens_per_sec"] > 0 and r["mfu"] is None
    evals = [r for r in records if "val_loss" in r]
    assert ([r["step"] for r in evals] == [3, 6]
            and evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"])))


def test_wandb_offline_run_receives_config_and_metrics(tmp_path):
    cfg = tiny_config(logging={"wandb_project": "megalite-test", "wandb_mode": "offline", "wandb_dir": str(tmp_path)})
    result = pretrain(cfg)
    run = read_run(result.wandb_dir.rsplit("/files", 1)[0])
    logged = {r["_step"]: r["loss"] for r in run["history"] if "loss" in r}
    assert logged == pytest.approx(result.losses)
    assert run["config"]["model"]["hidden_size"] == 64 and run["config"]["train"]["train_iters"] == 4


def test_wandb_run_is_resumed_after_restart(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    wandb = {"wandb_project": "megalite-test", "wandb_mode": "offline", "wandb_dir": str(tmp_path)}
    first = pretrain(tiny_config(train={"exit_interval": 2}, checkpoint={"save": ckpt, "load": ckpt}, logging=wandb))
    second = pretrain(tiny_config(checkpoint={"save": ckpt, "load": ckpt}, logging=wandb))
    assert first.wandb_run_id and first.wandb_run_id == second.wandb_run_id
    assert [r["_step"] for r in read_run(second.wandb_dir.rsplit("/files", 1)[0])["history"]] == [1, 2, 3, 4]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1  # one directory for the whole run
    assert "hidden_size: 64" in (tmp_path / "ckpt" / "iter_0000004" / "config.yaml").read_text()


def test_profile_steps_write_a_chrome_trace(tmp_path):
    pretrain(tiny_config(train={"train_iters": 3}, logging={"profile_steps": [2, 3], "profile_dir": str(tmp_path)}))
    trace = tmp_path / "rank0_steps2-3.pt.trace.json"
    assert trace.is_file() and "megalite step 3" in trace.read_text()
