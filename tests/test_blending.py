"""Blending: every prefix of the stream keeps each dataset's share close to its weight."""

from __future__ import annotations

import numpy as np
import pytest

from megalite.data import blending
from megalite.data.blending import BlendedDataset, blend_sizes, blending_indices, max_deviation, parse_blend

WEIGHT_SETS = [
    [1.0],
    [0.5, 0.5],
    [0.7, 0.3],
    [0.999, 0.001],
    [0.2, 0.3, 0.5],
    [1 / 3, 1 / 3, 1 / 3],
    [0.9] + [0.1 / 9] * 9,
    [3, 1, 4, 1, 5, 9, 2, 6],
    *[np.random.default_rng(seed).dirichlet(np.ones(d) * 0.5).tolist() for seed, d in enumerate([2, 3, 5, 12, 40])],
]


def _prefix_counts(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """[n, d] = samples of dataset d among the first n + 1."""
    return np.cumsum(dataset_index[:, None] == np.arange(num_datasets), axis=0)


@pytest.mark.parametrize("weights", WEIGHT_SETS, ids=lambda w: f"{len(w)}-datasets")
def test_share_bound_at_every_prefix(weights):
    size = 20_000
    w = np.asarray(weights) / np.sum(weights)
    dataset_index, sample_index = blending_indices(weights, size)
    counts = _prefix_counts(dataset_index, len(w))
    n = np.arange(1, size + 1)[:, None]
    deviation = np.abs(counts - n * w)
    assert np.all(deviation <= max_deviation(weights) + 1e-9), f"worst {deviation.max():.3f}"
    share_error = np.abs(counts / n - w)[50 * max(len(w) - 1, 1):]
    assert share_error.max() <= 0.01
    # each dataset's samples are taken in order 0, 1, 2, ...
    rank_within = counts[np.arange(size), dataset_index] - 1
    np.testing.assert_array_equal(sample_index, rank_within)


def test_two_datasets_are_interleaved_evenly():
    dataset_index, _ = blending_indices([0.75, 0.25], 8)
    assert dataset_index.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]


def test_deterministic_and_independent_of_chunking(monkeypatch):
    weights = [0.2, 0.05, 0.6, 0.15]
    whole = blending_indices(weights, 10_001)
    np.testing.assert_array_equal(whole[0], blending_indices(weights, 10_001)[0])
    monkeypatch.setattr(blending, "MERGE_CHUNK", 97)
    chunked = blending_indices(weights, 10_001)
    np.testing.assert_array_equal(whole[0], chunked[0])
    np.testing.assert_array_equal(whole[1], chunked[1])
    assert whole[0].dtype == np.int16 and whole[1].dtype == np.int64


@pytest.mark.parametrize("weights", WEIGHT_SETS, ids=lambda w: f"{len(w)}-datasets")
@pytest.mark.parametrize("size", [1, 7, 1000, 12_345])
def test_sizes_cover_the_blend_with_surplus(weights, size):
    sizes = blend_sizes(weights, size)
    drawn = np.bincount(blending_indices(weights, size)[0], minlength=len(weights))
    assert np.all(drawn <= sizes)
    w = np.asarray(weights) / np.sum(weights)
    assert np.all(np.array(sizes) >= np.ceil(np.ceil(size * w) * 1.005)), "Megatron's surplus at least"


def test_megatron_size_rule():
    assert blend_sizes([0.3, 0.7], 1_000_000) == [301_500, 703_500]
    assert blend_sizes([0.3, 0.7], 1_000_000, surplus=0.0) == [300_000, 700_000]


def test_blended_dataset():
    a, b = [f"a{i}" for i in range(100)], [f"b{i}" for i in range(100)]
    blend = BlendedDataset([a, b], [3, 1], 40)
    assert len(blend) == 40
    assert [blend[i] for i in range(8)] == ["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a5"]
    assert sum(s.startswith("a") for s in blend) == 30
    with pytest.raises(ValueError, match=r"blend_sizes\(weights, 40\)\[1\]"):
        BlendedDataset([a, b[:5]], [3, 1], 40)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendedDataset([a, b], [1.0], 40)


@pytest.mark.parametrize("weights", [[], [0.5, 0.0], [1, -1], [float("nan")]])
def test_bad_weights(weights):
    with pytest.raises(ValueError, match="positive numbers"):
        blending_indices(weights, 10)


def test_parse_blend():
    assert parse_blend(["data/a_text_document"]) == ([1.0], ["data/a_text_document"])
    assert parse_blend(["0.7", "a", "0.3", "b"]) == (pytest.approx([0.7, 0.3]), ["a", "b"])
    assert parse_blend([30, "a", 10, "b"]) == ([0.75, 0.25], ["a", "b"])


@pytest.mark.parametrize("bad, message", [
    ([], "weight prefix"),
    (["0.5"], "weight prefix"),
    (["0.7", "a", "0.3"], "weight prefix"),
    (["a", "b"], "entry 0 .'a'. should be a positive weight"),
    (["a", "0.7", "b", "0.3"], "should be a positive weight"),
    (["0.7", "0.3"], "entry 1 .'0.3'. is a number"),
    (["0", "a", "1", "b"], "positive weight"),
    (["-1", "a", "1", "b"], "positive weight"),
    (["inf", "a", "1", "b"], "positive weight"),
])
def test_parse_blend_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(bad)
