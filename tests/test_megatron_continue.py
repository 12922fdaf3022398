"""A Megatron-LM run continued in megalite trains on Megatron's next batches: the converter carries the data
settings of Megatron's args (megalite/checkpoint/megatron/data_args.py) into the config with
data.blend_rule=megatron and says what the user must check, and the continued run reads, from the checkpoint's
consumed samples on, the samples Megatron-Core's own builder gives there (megatron-core 0.16.1, run in its own
process by tests/megatron_reference.py).

The fixture is tests/fixtures/megatron/qwen_torch (test_megatron_convert.py), whose args name a 0.7/0.3 blend
of two corpora on Megatron's cluster, split 98,2,0, seed 1234, 100 steps of 2 samples, and 6 samples consumed.
Those corpora are not here: the test writes two of its own and overrides data.paths and data.cache_dir as a user
on another cluster would, with the launch flags the converter printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from corpus import write_corpus
from megatron_reference import run_reference

from megalite.checkpoint.megatron.data_args import data_from_args
from megalite.checkpoint.megatron.safe_pickle import load_megatron_pickle
from megalite.config_cli import parse_config
from megalite.training import pretrain as pretrain_module
from megalite.training.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/megatron/qwen_torch.tar.xz"
STEPS = 3  # steps the continued run takes: samples 6 to 11


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> Path:
    """The unpacked Megatron-LM checkpoint."""
    root = tmp_path_factory.mktemp("megatron")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(root, filter="data")
    return root / "qwen_torch"


def megatron_args(checkpoint: Path) -> argparse.Namespace:
    rank_file = checkpoint / "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
    return load_megatron_pickle(rank_file, str(rank_file))["args"]


def convert(load: Path, save: Path) -> None:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools/convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--from-megatron", "--load", str(load), "--save", str(save)])


def test_the_continued_run_trains_on_megatrons_next_samples(megatron, tmp_path, monkeypatch, capsys):
    convert(megatron, tmp_path / "converted")
    printed = capsys.readouterr().out
    assert "data.paths=['0.7', '/lustre/megatron/data/a_text_document', '0.3'" in printed
    assert "Megatron's samples 6, 7, ... next" in printed and "data.paths name Megatron's prefixes" in printed
    launch = printed.splitlines()[-1].split("pretrain_gpt.py ", 1)[1].split()
    args = megatron_args(megatron)
    a, b = (write_corpus(tmp_path / name, documents, seed, vocab=63) for name, documents, seed in
            (("a", 300, 1), ("b", 200, 2)))  # ids below Megatron's 64, eod 63 as its NullTokenizer's
    blend = [args.data_path[0], a, args.data_path[2], b]  # Megatron's weights, this machine's corpora
    cfg = parse_config([*launch, f"--data.paths={blend}", f"--data.cache_dir={tmp_path / 'cache'}",
                        "--parallel.tp=1", "--parallel.pp=1", "--parallel.distributed_optimizer=false",
                        "--data.num_workers=0", f"--train.exit_interval={3 + STEPS}", "--logging.progress_bar=false"])
    read, real = [], pretrain_module.micro_batches

    def recorded(*given, **kwargs):  # the run's own stream, each sample kept as it is trained on
        for batch in real(*given, **kwargs):
            read.append(torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1))
            yield batch

    monkeypatch.setattr(pretrain_module, "micro_batches", recorded)
    assert sorted(pretrain(cfg).losses) == [4, 5, 6]
    consumed, samples = args.consumed_train_samples, STEPS * args.global_batch_size
    run_reference({"scenarios": [{"name": "megatron", "blend": blend, "split": args.split, "seed": args.seed,
                                  "seq_length": args.seq_length, "samples": [consumed, samples],
                                  "sizes": [args.train_iters * args.global_batch_size, samples, 0]}]}, tmp_path)
    expected = np.load(tmp_path / "megatron.npz")["train/samples"]
    np.testing.assert_array_equal(torch.cat(read).numpy(), expected)


def _carry(args: argparse.Namespace, **changes):
    return data_from_args(argparse.Namespace(**vars(args) | changes), 200)


def test_what_carries_and_what_to_check(megatron, tmp_path):
    """Each data setting of Megatron's args: carried where megalite reads it the same, else named with the fix."""
    args = megatron_args(megatron)
    gpt2 = _carry(args, tokenizer_type="GPT2BPETokenizer", vocab_file="/m/vocab.json", merge_file="/m/merges.txt",
                  reset_position_ids=True, eod_mask_loss=True)
    assert (gpt2.data.tokenizer_type, gpt2.data.vocab_file, gpt2.data.merge_file) == (
        "GPT2BPETokenizer", "/m/vocab.json", "/m/merges.txt")
    assert gpt2.data.reset_position_ids and gpt2.data.eod_mask_loss and not gpt2.flags
    assert any("data.vocab_file, data.merge_file are Megatron's paths" in line for line in gpt2.check)
    llama2 = _carry(args, tokenizer_type="Llama2Tokenizer", tokenizer_model="/m/tokenizer.model")
    assert (llama2.data.tokenizer_type, llama2.data.tokenizer_model) == ("SentencePieceTokenizer", "/m/tokenizer.model")
    before_library = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "null_tokenizer_eod_id"})
    assert data_from_args(before_library, 200).data.tokenizer_type == "NullTokenizer"  # ids below 65, eod 64: ours
    (tmp_path / "blend.txt").write_text("0.5 /m/x 0.5 /m/y\n")
    from_file = _carry(args, data_path=None, data_args_path=str(tmp_path / "blend.txt"))
    assert from_file.data.paths == ["0.5", "/m/x", "0.5", "/m/y"]
    (tmp_path / "splits.json").write_text('{"train": "0.5 /m/x 0.5 /m/y", "valid": ["/m/y"], "test": null}')
    per_split = _carry(args, data_path=None, per_split_data_args_path=str(tmp_path / "splits.json"))
    assert (per_split.data.train_paths, per_split.data.valid_paths) == (["0.5", "/m/x", "0.5", "/m/y"], ["/m/y"])
    unweighted = _carry(args, data_path=["/m/x", "/m/y"], dataloader_type="cyclic", train_samples=201)
    assert unweighted.data.paths is None and unweighted.flags == ["--data.tokenizer_type=NullTokenizer",
                                                                  "--model.vocab_size=63"]
    starts = ["data.cache_dir is Megatron's", "args.data_path=['/m/x', '/m/y'] not carried",
              "args.tokenizer_type=NullTokenizer (ids below 64, eod 63) not carried",
              "Megatron sized its blend for args.train_samples=201, megalite for 200",
              "args.dataloader_type='cyclic' not reproduced"]
    assert len(unweighted.check) == len(starts) and all(map(str.startswith, unweighted.check, starts))
    nothing = _carry(args, data_path=None, data_cache_path=None)
    assert nothing.flags[0] == "--data.paths=..." and nothing.check[0].startswith("args name no blend")
