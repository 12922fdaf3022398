"""Bad checkpoints fail with a message naming the file and the fix, never half-load, and a damaged
latest checkpoint falls back to the previous complete one; retention; diverging steps."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_config

from megalite.checkpoint.local import choose_checkpoint
from megalite.training.pretrain import pretrain


@pytest.fixture
def saved(tmp_path):
    root = tmp_path / "ckpt"
    pretrain(tiny_config(train={"train_iters": 4}, checkpoint={"save": str(root), "save_interval": 2}))
    return root


def _resume(root, **checkpoint):
    return pretrain(tiny_config(train={"train_iters": 5}, checkpoint={"load": str(root), **checkpoint}))


def test_truncated_shard_is_named_and_falls_back(saved):
    shard = saved / "iter_0000004" / "rank_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError,
                       match=r"iter_0000004: rank_00000.safetensors is truncated .*checkpoint.fallback=true"):
        _resume(saved, fallback=False)
    found, skipped = choose_checkpoint(str(saved), fallback=True)
    assert found.name == "iter_0000002" and "truncated" in skipped[0]
    assert _resume(saved).losses.keys() == {3, 4, 5}


def test_corrupt_and_missing_files_are_named(saved):
    shard = saved / "iter_0000004" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"rank_00000.safetensors is corrupt \(CRC-32"):
        _resume(saved / "iter_0000004")
    (saved / "iter_0000002" / "index.json").unlink()
    with pytest.raises(ValueError, match=r"iter_0000002 is incomplete: index.json is missing"):
        _resume(saved / "iter_0000002")
    with pytest.raises(ValueError, match=r"no complete checkpoint in .*corrupt.*index.json is missing"):
        _resume(saved)


def test_an_iteration_directory_resumes_exactly_there(saved):
    assert _resume(saved / "iter_0000002").losses.keys() == {3, 4, 5}
    assert _resume(saved).losses.keys() == {5}


def test_other_model_shape_is_refused(saved):
    with pytest.raises(ValueError, match=r"does not fit this model.*layers.0.mlp.linear_fc1.weight"):
        pretrain(tiny_config(train={"train_iters": 5}, model={"ffn_hidden_size": 128}, checkpoint={"load": str(saved)}))


def test_dangling_latest_pointer(saved):
    (saved / "latest").write_text("7\n")
    with pytest.raises(FileNotFoundError, match=r"names iteration 7 but .*iter_0000007 does not exist"):
        _resume(saved)


def test_typo_in_load_path_is_not_a_fresh_start(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint.load=.*does not exist"):
        pretrain(tiny_config(checkpoint={"load": str(tmp_path / "typo")}))


def test_no_temporary_directories_remain(saved):
    assert sorted(p.name for p in saved.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]
    assert json.loads((saved / "iter_0000004" / "index.json").read_text())["format_version"] == 2


def test_keep_last_prunes_only_after_a_newer_checkpoint_is_complete(tmp_path):
    root = tmp_path / "ckpt"
    pretrain(tiny_config(train={"train_iters": 6},
                         checkpoint={"save": str(root), "save_interval": 2, "keep_last": 2, "async_save": True}))
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000006", "latest"]


def test_restart_resumes_from_save_directory_by_default(tmp_path):
    """checkpoint.load defaults to checkpoint.save: relaunching the same command continues the run."""
    cfg = {"save": str(tmp_path / "ckpt"), "save_interval": 2}
    straight = pretrain(tiny_config(train={"train_iters": 4})).losses
    pretrain(tiny_config(train={"train_iters": 4, "exit_interval": 2}, checkpoint=cfg))
    assert pretrain(tiny_config(train={"train_iters": 4}, checkpoint=cfg)).losses == {k: straight[k] for k in (3, 4)}


def test_a_relaunch_resumes_its_own_saves_not_the_checkpoint_it_started_from(saved, tmp_path):
    """checkpoint.load is where a run starts (a converted model, another run's checkpoint); once checkpoint.save
    holds a checkpoint of its own, relaunching the same command continues from there and loses no steps."""
    cfg = {"load": str(saved), "save": str(tmp_path / "mine"), "save_interval": 1}
    assert sorted(pretrain(tiny_config(train={"train_iters": 6, "exit_interval": 5}, checkpoint=cfg)).losses) == [5]
    assert sorted(pretrain(tiny_config(train={"train_iters": 6}, checkpoint=cfg)).losses) == [6]


def test_diverging_steps_are_skipped_then_stop_with_a_checkpoint(tmp_path):
    """An absurd LR makes the weights blow up: every later step has a NaN/Inf gradient norm, is
    skipped (weights untouched), and after train.max_skipped_steps in a row the run stops, saving."""
    root = tmp_path / "ckpt"
    cfg = tiny_config(train={"train_iters": 20, "max_skipped_steps": 3},
                      optim={"lr": 1e30, "min_lr": 0.0, "clip_grad": 0.0}, checkpoint={"save": str(root)})
    with pytest.raises(FloatingPointError,
                       match=r"3 consecutive steps had a NaN/Inf .*last good weights are in .*iter_"):
        pretrain(cfg)
    state = json.loads((root / f"iter_{int((root / 'latest').read_text()):07d}" / "state.json").read_text())
    assert state["skipped_steps"] >= 3 and state["step"] < 20
