"""Bad checkpoints fail with a message naming the file and the fix, and never half-load."""

from __future__ import annotations

import pytest

from megalite.training.pretrain import pretrain

from conftest import tiny_config


@pytest.fixture
def saved(tmp_path):
    root = tmp_path / "ckpt"
    pretrain(tiny_config(train={"train_iters": 2}, checkpoint={"save": str(root)}))
    return root


def test_missing_shard_is_named(saved):
    (saved / "iter_0000002" / "optimizer_000.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"iter_0000002 is incomplete: optimizer_000.safetensors is missing"):
        pretrain(tiny_config(train={"train_iters": 3}, checkpoint={"load": str(saved)}))


def test_other_model_shape_is_refused(saved):
    with pytest.raises(ValueError, match=r"does not fit this model.*layers.0.mlp.linear_fc1.weight"):
        pretrain(tiny_config(train={"train_iters": 3}, model={"ffn_hidden_size": 128}, checkpoint={"load": str(saved)}))


def test_dangling_latest_pointer(saved):
    (saved / "latest").write_text("7\n")
    with pytest.raises(FileNotFoundError, match=r"names iteration 7 but .*iter_0000007 does not exist"):
        pretrain(tiny_config(train={"train_iters": 3}, checkpoint={"load": str(saved)}))


def test_typo_in_load_path_is_not_a_fresh_start(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint.load=.*does not exist"):
        pretrain(tiny_config(checkpoint={"load": str(tmp_path / "typo")}))


def test_no_temporary_directories_remain(saved):
    assert sorted(p.name for p in saved.iterdir()) == ["iter_0000002", "latest"]
