"""No silent wrong results, and errors in what the user gave reported once per job as lines naming the field
or file and the fix (issue 34, points 3 and 5): a resume that would change the model's shapes or meaning is
refused, token ids beyond the vocabulary are caught before the embedding, empty or mixed datasets are named,
only one rank prints an error and torchrun's failure block shows it as the root cause; `--check` validates a
launch without starting it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import tiny_config
from distributed import ROOT

from megalite.checkpoint.compatibility import CheckpointMismatch
from megalite.data.gpt_dataset import TokenOutOfVocabulary, Vocabulary
from megalite.data.indexed_dataset import IndexedDatasetError, IndexedDatasetWriter, stats_file_path
from megalite.training.pretrain import pretrain

_spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "pretrain_gpt.py")
pretrain_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pretrain_gpt)

NULL_300 = {"type": "NullTokenizer", "vocab_size": 301, "eod": 300}


def _save(root, steps: int = 1, **model) -> None:
    pretrain(tiny_config(model=model, train={"train_iters": steps}, checkpoint={"save": str(root)}))


def test_a_resume_with_another_model_is_refused_naming_the_fields(tmp_path):
    """A 4-layer checkpoint resumed with 2 layers once loaded and dropped two layers without a word."""
    _save(tmp_path, num_layers=4)
    with pytest.raises(CheckpointMismatch) as refused:
        pretrain(tiny_config(model={"num_layers": 2, "hidden_size": 32}, checkpoint={"save": str(tmp_path)}))
    message = str(refused.value)
    assert "\n" not in message and len(message) - len(str(tmp_path)) < 900
    assert "model.num_layers=4 in the checkpoint, 2 here; model.hidden_size=64 in the checkpoint, 32 here" in message
    assert "24 this model has no place for (layers.2.attention.linear_proj.bias" in message
    assert "--model.num_layers=4 --model.hidden_size=64" in message


def test_context_extension_and_dropout_resume_and_are_logged(tmp_path, capsys):
    pretrain(tiny_config("llama", train={"train_iters": 1}, checkpoint={"save": str(tmp_path)}))
    capsys.readouterr()
    extended = {"seq_length": 64, "rope_theta": 50000.0, "hidden_dropout": 0.1}
    result = pretrain(tiny_config("llama", model=extended, train={"train_iters": 2},
                                  checkpoint={"save": str(tmp_path)}))
    assert result.losses.keys() == {2}
    assert (f"model changed since {tmp_path}/iter_0000001 was saved: model.seq_length 32 -> 64, "
            "model.max_position_embeddings 32 -> 64, model.rope_theta 10000.0 -> 50000.0, "
            "model.hidden_dropout 0.0 -> 0.1") in capsys.readouterr().out


def test_tensors_the_model_has_no_place_for_are_refused_by_name(tmp_path):
    """A checkpoint whose config agrees with the run but holds more tensors (edited by hand, converted by a tool
    that left some out of its config) is refused: its weights would be dropped."""
    _save(tmp_path, num_layers=4)
    config = tmp_path / "iter_0000001" / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    saved["model"]["num_layers"] = 2
    config.write_text(yaml.safe_dump(saved))
    with pytest.raises(CheckpointMismatch, match=r"tensors: 24 this model has no place for \(layers\.2\."):
        pretrain(tiny_config(train={"train_iters": 2}, checkpoint={"save": str(tmp_path)}))


def test_another_width_names_the_field_in_one_short_line(tmp_path):
    """Once a 3 KB list of every tensor's shapes."""
    _save(tmp_path)
    with pytest.raises(CheckpointMismatch) as refused:
        pretrain(tiny_config(model={"ffn_hidden_size": 128}, checkpoint={"load": str(tmp_path)}))
    assert str(refused.value).startswith(f"checkpoint {tmp_path}/iter_0000001 does not fit this model (saved with "
                                         "another model config): model.ffn_hidden_size=256 in the checkpoint, 128 "
                                         "here; tensors: 6 of other shapes (layers.0.mlp.linear_fc1.bias: (256,) in "
                                         "the checkpoint, (128,) here; also layers.0.mlp.linear_fc1.weight")


def _corpus(prefix, largest: int, tokenizer: dict | None = NULL_300) -> str:
    """40 documents of 30 ids up to `largest` (every document holds it), with the stats preprocessing records."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(prefix), np.uint16, tokenizer) as writer:
        writer.add_documents([np.append(rng.integers(0, 300, 29), largest) for _ in range(40)])
    return str(prefix)


def _train_on(*paths: str, workers: int = 0) -> None:
    blend = [item for path in paths for item in (1.0, path)] if len(paths) > 1 else list(paths)
    pretrain(tiny_config(model={"vocab_size": 300}, train={"train_iters": 1},
                         data={"mock": False, "paths": blend, "split": "1,0,0", "tokenizer_type": "NullTokenizer",
                               "num_workers": workers}))


def test_token_ids_beyond_the_vocabulary_are_caught_at_start_up_by_the_recorded_largest_id(tmp_path):
    """A corpus of another tokenizer once failed inside the embedding: an IndexError on a CPU, a device-side
    assert on a GPU. Preprocessing records the largest id beside the .idx; the run checks it before any step."""
    prefix = _corpus(tmp_path / "other", largest=1000, tokenizer={"type": "NullTokenizer", "vocab_size": 1001})
    with pytest.raises(TokenOutOfVocabulary, match=rf"^{prefix} \(by {prefix}.stats.json, written by preprocessing\) "
                                                   r"holds token id 1000, outside the vocabulary of 301 ids of "
                                                   r"data.tokenizer_type=NullTokenizer: the corpus was tokenized"):
        _train_on(prefix)


def test_token_ids_beyond_the_vocabulary_are_caught_as_each_sample_is_read(tmp_path):
    """Without the record (a Megatron-LM dataset), the loader's worker checks every sample it reads; the error is
    the worker's one line, not torch's re-raised traceback."""
    prefix = _corpus(tmp_path / "megatron", largest=5000)
    os.remove(stats_file_path(prefix))
    with pytest.raises(TokenOutOfVocabulary) as caught:
        _train_on(prefix, workers=1)
    assert str(caught.value).startswith(f"{prefix} split=1,0,0 part=0, sample ")
    assert "holds token id 5000, outside the vocabulary of 301 ids" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_sample_check_takes_negative_ids_too():
    """An int32 corpus can hold negative ids (corrupt, or written by hand); one unsigned max catches both ends."""
    vocab = Vocabulary(300, "data.tokenizer_type=NullTokenizer")
    vocab.check(np.array([0, 150, 299]), "fine")
    for bad, tokens in ((-2, [1, -2, 400]), (300, [300, 1])):
        with pytest.raises(TokenOutOfVocabulary, match=rf"^here holds token id {bad}, outside the vocabulary of 300"):
            vocab.check(np.array(tokens), "here")


def test_empty_and_mixed_datasets_are_named(tmp_path):
    """An empty dataset (what a wrong --json-keys wrote) was reported as "data.split leaves no training documents";
    a blend of datasets made with different tokenizers trained on meaningless ids."""
    with IndexedDatasetWriter(str(tmp_path / "empty"), np.uint16):
        pass
    with pytest.raises(IndexedDatasetError, match=rf"^{tmp_path}/empty.bin holds no tokens: re-run "
                                                  r"tools/preprocess_data.py with the --json-keys field"):
        _train_on(str(tmp_path / "empty"))
    ours = _corpus(tmp_path / "ours", largest=299)
    theirs = _corpus(tmp_path / "theirs", largest=299, tokenizer={"type": "GPT2BPETokenizer", "vocab_size": 50257})
    with pytest.raises(IndexedDatasetError, match=rf"the blend mixes tokenizers: {ours} was tokenized with .*"
                                                  rf"NullTokenizer.*, {theirs} with .*GPT2BPETokenizer"):
        _train_on(ours, theirs)


def test_an_error_is_printed_by_one_rank_and_is_torchruns_root_cause(tmp_path):
    """Under torchrun every rank once printed its traceback, then torchrun listed every rank's failure."""
    missing = tmp_path / "typo"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "pretrain_gpt.py"), "--config", "examples/tiny_cpu.yaml", "--data.mock=true",
                           f"--checkpoint.load={missing}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    message = f"pretrain_gpt.py: error: checkpoint.load={missing} does not exist; fix the path or drop"
    lines = done.stderr.splitlines()
    assert done.returncode != 0 and sum(line.startswith(message) for line in lines) == 1, done.stderr[-3000:]
    assert "<NO_OTHER_FAILURES>" in done.stderr and f"traceback : {message}" in done.stderr
    assert "[rank" not in done.stderr and "MissingInput" not in done.stderr


def test_before_the_process_group_local_rank_0_prints_and_the_others_exit_quietly(tmp_path, capsys, monkeypatch):
    bad = ["--data.mock=true", "--model.hidden_size=130"]
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pretrain_gpt.main(bad) == 0 and capsys.readouterr().err == "" and not error_file.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pretrain_gpt.main(bad) == 2
    printed = capsys.readouterr().err
    assert printed.startswith("pretrain_gpt.py: error: invalid configuration:\n  - model.hidden_size=130 is not")
    assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == printed.strip()


def test_check_validates_a_launch_without_starting_it(tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus", largest=299)
    args = ["--config", "examples/tiny_cpu.yaml", f"--data.paths={corpus}", "--data.tokenizer_type=NullTokenizer",
            "--model.vocab_size=300", f"--checkpoint.save={tmp_path / 'ckpt'}"]
    assert pretrain_gpt.main(["--check", "--nproc-per-node", "2", *args]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("pretrain_gpt.py --check: this launch is valid\nworld 2: tp 1, pp 1, dp 2")
    assert "data.paths: 1 dataset(s), 40 documents, 1,200 tokens" in shown
    assert f"checkpoint: none in {tmp_path / 'ckpt'} yet; the run starts from scratch" in shown
    assert f"launch: torchrun --nproc-per-node=2 pretrain_gpt.py {' '.join(args)}" in shown
    assert not (tmp_path / "ckpt").exists()
    other = _corpus(tmp_path / "other", largest=1000, tokenizer={"type": "NullTokenizer", "vocab_size": 1001})
    wrong = ["--check", "--nproc-per-node=3", "--nnodes=1", *args, "--parallel.tp=2", f"--data.paths={other}"]
    assert pretrain_gpt.main(wrong) == 2
    problems = capsys.readouterr().err.splitlines()
    assert problems[0] == "pretrain_gpt.py: error: this launch would fail:"
    assert problems[1].startswith("  - world size 3 is not divisible by parallel.tp*parallel.pp=2; launch a multiple "
                                  "of tp*pp processes (dp = world/(tp*pp)), e.g. torchrun --nproc-per-node=2 ")
    assert problems[2].startswith(f"  - {other} (by {other}.stats.json, written by preprocessing) holds token id 1000")
