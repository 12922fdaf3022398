"""Resuming reads only what each rank holds, verifies it, and never resets optimizer state silently.

- At its own layout a rank reads exactly the bytes it saved; resharded, each rank reads less than
  the checkpoint (only a one-device load reads all of it).
- A corrupt piece is found by the rank that reads it, and every rank falls back together.
- A checkpoint whose optimizer state lacks Adam's step (as apex's FusedAdam wrote them: it kept
  `step` in its param groups) stops the resume naming what is missing, unless
  checkpoint.load_optimizer=false; a weights-only checkpoint starts Adam afresh and says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from distributed import cpu_topology, run_ranks

from megalite.checkpoint.local import load_checkpoint
from megalite.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from megalite.config_cli import parse_config
from megalite.training.build import build_trainer
from megalite.training.pretrain import pretrain

ARGS = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
        "--model.vocab_size=300", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=4",
        "--logging.progress_bar=false", "--data.mock=true", "--data.num_workers=0", "--train.device=cpu",
        "--parallel.bucket_size=3000"]
SAVED_AT = ["--parallel.tp=2", "--parallel.distributed_optimizer=true"]  # at world size 4: dp 2


def _train(rank: int, world_size: int, runs: list[list[str]]) -> list[dict[int, float]]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    return [pretrain(parse_config([*ARGS, *args])).losses for args in runs]


def _bytes_read(rank: int, world_size: int, path: str, layout: list[str]) -> tuple[int, int]:
    """(bytes this rank read, bytes of what it holds: its fp32 weights, Adam's two moments and one step
    per slice it steps)."""
    cfg = parse_config([*ARGS, *layout])
    topology = cpu_topology(rank, world_size, cfg)
    sharded = build_trainer(cfg, topology).sharded_state()
    return load_checkpoint(Path(path), sharded, topology)[3], sum(12 * (e.hi - e.lo) + 4 for e in sharded.entries)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume-io") / "ckpt"
    run_ranks(4, _train, [[*SAVED_AT, f"--checkpoint.save={root}", "--train.exit_interval=2"]])
    return root / "iter_0000002"


def test_each_rank_reads_only_what_it_holds(saved):
    index = json.loads((saved / "index.json").read_text())
    total = sum(4 * (p["hi"] - p["lo"]) for p in index["pieces"])  # every piece is fp32 here
    for read, held in run_ranks(4, _bytes_read, str(saved), SAVED_AT):
        assert read == held
    for world_size, layout in ((4, ["--parallel.distributed_optimizer=true"]), (2, ["--parallel.tp=2"]),
                               (4, ["--parallel.pp=2", "--parallel.distributed_optimizer=true"])):
        per_rank = run_ranks(world_size, _bytes_read, str(saved), layout)
        assert all(held <= read < total for read, held in per_rank), (layout, per_rank, total)
    assert run_ranks(1, _bytes_read, str(saved), [])[0][0] == total


def test_a_corrupt_piece_is_found_by_its_reader_and_every_rank_falls_back(tmp_path):
    root = tmp_path / "ckpt"
    straight, first = run_ranks(2, _train, [["--parallel.distributed_optimizer=true"],
                                            ["--parallel.distributed_optimizer=true", f"--checkpoint.save={root}",
                                             "--checkpoint.save_interval=1", "--train.exit_interval=3"]])[-1]
    shard = root / "iter_0000003" / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # only rank 1 reads this file at the same layout
    shard.write_bytes(bytes(data))
    resumed = run_ranks(2, _train, [["--parallel.distributed_optimizer=true", f"--checkpoint.save={root}"]])[-1][0]
    assert resumed == pytest.approx({k: straight[k] for k in (3, 4)}, rel=1e-6)


def _without_step_pieces(path: Path) -> None:
    index = json.loads((path / "index.json").read_text())
    index["pieces"] = [p for p in index["pieces"] if p["kind"] != "step"]
    (path / "index.json").write_text(json.dumps(index))


def test_optimizer_state_without_steps_is_refused_unless_asked_for(tmp_path, capsys):
    root = tmp_path / "ckpt"
    pretrain(parse_config([*ARGS, f"--checkpoint.save={root}", "--train.exit_interval=2"]))
    _without_step_pieces(root / "iter_0000002")
    with pytest.raises(ValueError, match=r"has optimizer state, but not step of .*--checkpoint.load_optimizer=false"):
        pretrain(parse_config([*ARGS, f"--checkpoint.save={root}"]))
    result = pretrain(parse_config([*ARGS, f"--checkpoint.save={root}", "--checkpoint.load_optimizer=false"]))
    assert result.losses.keys() == {3, 4}
    assert "optimizer state not loaded (checkpoint.load_optimizer=false)" in capsys.readouterr().out


def test_weights_only_checkpoint_starts_adam_afresh_and_says_so(tmp_path, capsys):
    root = tmp_path / "ckpt"
    pretrain(parse_config([*ARGS, f"--checkpoint.save={root}", "--train.train_iters=2"]))
    cfg, tensors = read_model_tensors(root)
    write_model_checkpoint(tmp_path / "weights", cfg, tensors)
    capsys.readouterr()
    result = pretrain(parse_config([*ARGS, f"--checkpoint.load={tmp_path / 'weights'}"]))
    assert result.losses.keys() == {1, 2, 3, 4}
    assert "optimizer state not loaded (the checkpoint holds weights only)" in capsys.readouterr().out


def test_a_damaged_file_header_falls_back_too(tmp_path):
    root = tmp_path / "ckpt"
    straight = pretrain(parse_config([*ARGS, f"--checkpoint.save={root}", "--checkpoint.save_interval=1"])).losses
    shard = root / "iter_0000004" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\xff" * 8  # inside the JSON header: safetensors cannot open the file
    shard.write_bytes(bytes(data))
    (root / "latest").write_text("4\n")
    resumed = pretrain(parse_config([*ARGS, f"--checkpoint.save={root}", "--train.train_iters=5"])).losses
    assert resumed.keys() == {4, 5} and resumed[4] == pytest.approx(straight[4], rel=1e-6)
