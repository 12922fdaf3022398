"""data.blend_rule=megatron: Megatron-Core's blend exactly, checked against Megatron-Core's own builder
(megatron-core, a test-only dependency, run in its own process by tests/megatron_reference.py): per-dataset
sizes, the blend's (dataset, sample) order, every dataset's document / sample / shuffle index, the split's
document ranges, and the samples a run resumed at consumed_samples=N trains on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from corpus import write_corpus
from megatron_reference import run_reference

from megalite.config import Config, ConfigError
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.data import megatron_blending
from megalite.data.blending import BlendedDataset, blending_indices, parse_blend
from megalite.data.build import build_training_data, training_tokenizer
from megalite.data.gpt_dataset import split_documents
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.data.loader import micro_batches
from megalite.data.megatron_blending import megatron_blend_sizes, megatron_blending_indices, normalise
from megalite.training.pretrain import pretrain

SEQ, SEED, VOCAB = 16, 1234, 1 << 30
CORPORA = {"a": 400, "b": 150, "c": 260}  # documents each
SCENARIOS = [  # Megatron-LM's data arguments; "samples": the resume point N and how many samples to compare from it
    {"name": "two", "blend": ["0.7", "a", "0.3", "b"], "split": "98,2,0", "sizes": [2000, 120, 0],
     "samples": [1000, 64]},
    {"name": "three", "blend": ["5", "a", "3", "b", "2", "c"], "split": "90,5,5", "sizes": [3000, 96, 32],
     "samples": [1496, 64]},
    {"name": "per_split", "blend_per_split": [["0.65", "a", "0.35", "c"], ["b"], None], "sizes": [1000, 64, 0],
     "samples": [500, 32]},
    {"name": "weighted_single", "blend": ["1.0", "a"], "split": "95,5,0", "sizes": [800, 32, 0],
     "samples": [400, 32]},
    {"name": "single", "blend": ["a"], "split": "95,5,0", "sizes": [800, 32, 0], "samples": [400, 32]},
]
SPLIT_CASES = [(n, split) for split in ("969,30,1", "949,50,1", "90,5,5", "7,2,1", "0.7,0.2,0.1", "1,1,1", "98,2")
               for n in range(1, 1200)]


def _write_corpus(prefix: Path, documents: int, corpus: int) -> None:
    """Documents of 1 to 40 tokens whose ids tell the corpus and position (corpus * 10**6 + position), so a
    sample shows where it was cut from."""
    lengths = 1 + (37 * np.arange(documents) + 11 * corpus) % 40
    starts = np.concatenate([[0], np.cumsum(lengths)])
    with IndexedDatasetWriter(str(prefix), np.int32) as writer:
        for start, length in zip(starts, lengths):
            writer.add_document(corpus * 10**6 + np.arange(start, start + length, dtype=np.int32))


def _paths(items: list[str] | None, root: Path) -> list[str] | None:
    """A blend list with corpus names replaced by their prefixes under root."""
    return None if items is None else [str(root / x) if x in CORPORA else x for x in items]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpora")
    for corpus, (name, documents) in enumerate(CORPORA.items()):
        _write_corpus(root / name, documents, corpus)
    return root


@pytest.fixture(scope="module")
def megatron(corpora, tmp_path_factory) -> Path:
    """Megatron-Core's datasets for every scenario, built by megatron-core itself in its own process."""
    out = tmp_path_factory.mktemp("megatron")
    scenarios = [{**s, "seq_length": SEQ, "seed": SEED, **({"blend": _paths(s["blend"], corpora)} if "blend" in s else
                  {"blend_per_split": [_paths(b, corpora) for b in s["blend_per_split"]]})} for s in SCENARIOS]
    run_reference({"scenarios": scenarios, "split_bounds": SPLIT_CASES}, out)
    return out


def _config(scenario: dict, corpora: Path, cache: Path) -> Config:
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed = SEQ, VOCAB, SEED
    d = cfg.data
    d.mock, d.tokenizer_type, d.cache_dir, d.num_workers = False, "NullTokenizer", str(cache), 0
    d.blend_rule = "megatron"
    if "blend" in scenario:
        d.paths, d.split = _paths(scenario["blend"], corpora), scenario["split"]
    else:
        d.train_paths, d.valid_paths = (_paths(b, corpora) for b in scenario["blend_per_split"][:2])
    return cfg


def _assert_same_dataset(ours, theirs: dict, split: str) -> None:
    """Our dataset (a blend or one GPTDataset) has Megatron-Core's length, blend order and indices."""
    assert len(ours) == theirs[f"{split}/length"]
    parts = ours.datasets if isinstance(ours, BlendedDataset) else [ours]
    if f"{split}/dataset_index" in theirs:
        np.testing.assert_array_equal(ours.dataset_index, theirs[f"{split}/dataset_index"])
        np.testing.assert_array_equal(ours.dataset_sample_index, theirs[f"{split}/dataset_sample_index"])
    for p, part in enumerate(parts):
        assert len(part) == theirs[f"{split}/part{p}/length"]
        for name in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(part, name), theirs[f"{split}/part{p}/{name}"], err_msg=name)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s["name"])
def test_datasets_equal_megatron_cores(scenario, corpora, megatron, tmp_path):
    theirs = dict(np.load(megatron / f"{scenario['name']}.npz"))
    cfg = _config(scenario, corpora, tmp_path / "cache")
    train_samples, valid_samples, _ = scenario["sizes"]
    data = build_training_data(cfg, 0, training_tokenizer(cfg.data, VOCAB), train_samples, valid_samples)
    _assert_same_dataset(data.train, theirs, "train")
    _assert_same_dataset(data.valid, theirs, "valid")
    np.testing.assert_array_equal(np.stack([data.valid[i] for i in range(8)]), theirs["valid/samples"])
    blend = scenario.get("blend") or scenario["blend_per_split"][0]
    if len(blend) > 1:  # a weighted blend: Megatron-Core's per-dataset sizes, surplus included
        sizes, length = megatron_blend_sizes(parse_blend(blend)[0], train_samples)
        assert sizes == [int(theirs[f"train/part{p}/num_samples"]) for p in range(len(sizes))]
        assert length == theirs["train/length"]


@pytest.mark.parametrize("dp, micro_batch_size", [(1, 4), (2, 2)])
@pytest.mark.parametrize("scenario", SCENARIOS[:3], ids=lambda s: s["name"])
def test_resume_at_consumed_samples_reads_megatrons_next_samples(scenario, dp, micro_batch_size, corpora, megatron,
                                                                  tmp_path):
    """A run resumed at consumed_samples=N (Run.train's stream: micro_batches from N) trains on Megatron-LM's
    blended samples N, N+1, ...: rank r's micro batch m holds samples N + (m * dp + r) * mb + [0, mb)."""
    first, count = scenario["samples"]
    expected = np.load(megatron / f"{scenario['name']}.npz")["train/samples"]
    cfg = _config(scenario, corpora, tmp_path / "cache")
    data = build_training_data(cfg, 0, training_tokenizer(cfg.data, VOCAB), scenario["sizes"][0], 0)
    per_rank = [list(micro_batches(data.train, data.maker, first, first + count, micro_batch_size, dp, rank, 0,
                                   torch.device("cpu"))) for rank in range(dp)]
    read = torch.cat([torch.cat([b.tokens, b.labels[:, -1:]], dim=1) for m in range(len(per_rank[0]))
                      for b in (per_rank[rank][m] for rank in range(dp))])
    np.testing.assert_array_equal(read.numpy(), expected)


def test_split_ranges_equal_megatron_cores(megatron):
    """Also where the order of float operations decides a bound that falls on a half (30 documents at 90,5,5:
    valid is [27, 29), where normalising after summing gave [27, 28))."""
    bounds = json.loads((megatron / "split_bounds.json").read_text())
    for (n, split), theirs in zip(SPLIT_CASES, bounds):
        ours = [[int(ids[0]), int(ids[-1]) + 1] if len(ids) else None for ids in split_documents(n, split)]
        assert [b if b is None or b[0] < b[1] else None for b in theirs] == ours, (n, split)
    assert [len(ids) for ids in split_documents(30, "90,5,5")] == [27, 2, 1]


def _helpers_cpp_loop(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    """helpers.cpp's build_blending_indices, line for line."""
    counts, dataset_index, dataset_sample_index = [0] * len(weights), [], []
    for i in range(size):
        errors = [w * max(float(i), 1.0) - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))  # the first maximum: `error > max_error` keeps the lowest index on ties
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, dataset_sample_index


GREEDY_WEIGHTS = [[0.7, 0.3], [1 / 3] * 3, [0.5, 0.25, 0.25], [0.01] * 100, [0.999, 0.001], [3, 1, 4, 1, 5, 9, 2, 6],
                  *[np.random.default_rng(seed).dirichlet(np.ones(d) * 0.5).tolist() for seed, d in enumerate([3, 12])]]


@pytest.mark.parametrize("weights", GREEDY_WEIGHTS, ids=lambda w: f"{len(w)}-datasets")
@pytest.mark.parametrize("chunk, lanes", [(4096, 1 << 22), (7, 1 << 22), (5, 40)])
def test_greedy_equals_the_sequential_loop(weights, chunk, lanes, monkeypatch):
    """However the stream is cut into chunks run side by side (and windows of chunks), with whatever reruns
    the guessed starts need, it is the sequential loop's."""
    monkeypatch.setattr(megatron_blending, "CHUNK", chunk)
    monkeypatch.setattr(megatron_blending, "LANES", lanes)
    builder_weights = normalise(weights).tolist()
    expected = _helpers_cpp_loop(normalise(builder_weights).tolist(), 3001)
    for size in (0, 1, 2, 13, 3001):
        dataset_index, dataset_sample_index = megatron_blending_indices(builder_weights, size)
        assert dataset_index.dtype == np.int16 and dataset_sample_index.dtype == np.int64
        assert dataset_index.tolist() == expected[0][:size] and dataset_sample_index.tolist() == expected[1][:size]


def test_megatron_order_differs_from_megalites_at_sample_4():
    megatron_order = megatron_blending_indices([0.7, 0.3], 12)[0].tolist()
    assert megatron_order == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1]  # as Megatron-Core's BlendedDataset
    assert blending_indices([0.7, 0.3], 12)[0].tolist()[:4] == megatron_order[:4]
    assert blending_indices([0.7, 0.3], 12)[0].tolist()[4] != megatron_order[4]


def test_megatron_sizes():
    assert megatron_blend_sizes([0.3, 0.7], 1_000_000) == ([301_500, 703_500], 1_000_000)
    assert megatron_blend_sizes([0.5, 0.5], 3) == ([3, 3], 4), "ceil(1.5) = 2 each: the blend is 4 long"
    with pytest.raises(ValueError, match="must be normalised"):
        megatron_blend_sizes([3, 1], 10)


def test_a_dataset_run_dry_names_the_fix():
    weights = [0.5, 0.5]
    sizes, length = megatron_blend_sizes(weights, 3)
    with pytest.raises(ValueError, match="surplus of 0.005 is too small.*blend_rule=megalite"):
        BlendedDataset([list(range(sizes[0])), list(range(1))], weights, length, "megatron")


def test_blend_rule_config():
    assert parse_config(["--data.mock=true"]).data.blend_rule == "megalite", "megalite's rule stays the default"
    assert parse_config(["--data.mock=true", "--data.blend_rule=megatron"]).data.blend_rule == "megatron"
    with pytest.raises(ConfigError, match="data.blend_rule: 'nvidia' is not one of megalite, megatron"):
        parse_config(["--data.mock=true", "--data.blend_rule=nvidia"])
    cfg = Config()
    cfg.data.mock, cfg.data.tokenizer_type, cfg.data.blend_rule = False, "NullTokenizer", "megatron"
    cfg.data.paths = [x for d in range(megatron_blending.MAX_DATASETS + 1) for x in ("1", f"corpus{d}")]
    with pytest.raises(ConfigError, match="data.paths blends 32767 datasets.*at most 32766.*blend_rule=megalite"):
        validate(cfg, 1)
    cfg.data.blend_rule = "megalite"
    validate(cfg, 1)


def test_pretrain_resumes_on_a_megatron_blend(tmp_path):
    """The training loop on blend_rule=megatron: stopped after 2 steps and resumed from its consumed samples,
    it ends with the uninterrupted run's losses."""
    a, b = write_corpus(tmp_path / "a", 300, 1), write_corpus(tmp_path / "b", 200, 2)
    data = {"mock": False, "paths": ["0.7", a, "0.3", b], "split": "90,10,0", "tokenizer_type": "NullTokenizer",
            "num_workers": 0, "blend_rule": "megatron"}
    straight = pretrain(tiny_config(data=data, train={"train_iters": 4})).losses
    ckpt = {"save": str(tmp_path / "ckpt"), "load": str(tmp_path / "ckpt")}
    first = pretrain(tiny_config(data=data, train={"train_iters": 4, "exit_interval": 2}, checkpoint=ckpt)).losses
    second = pretrain(tiny_config(data=data, train={"train_iters": 4}, checkpoint=ckpt)).losses
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    assert {**first, **second} == straight
