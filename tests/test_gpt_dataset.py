"""GPTDataset indices: windows of the shuffled document stream, epochs, the cache; document splits."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megalite.data import gpt_dataset
from megalite.data.gpt_dataset import GPTDataset, split_documents
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


class FakeDocuments:
    """In-memory TokenDocuments whose token values are their positions in the corpus, so any
    sample shows exactly which tokens it was cut from."""

    def __init__(self, lengths) -> None:
        self.sequence_lengths = np.asarray(lengths, dtype=np.int32)
        self.starts = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        assert 0 <= offset and offset + length <= self.sequence_lengths[i]
        return np.arange(self.starts[i] + offset, self.starts[i] + offset + length, dtype=np.uint32)


def _docs(n: int = 40, seed: int = 0) -> FakeDocuments:
    return FakeDocuments(np.random.default_rng(seed).integers(1, 30, n))


def _dataset(docs, ids=None, num_samples=20, seq=16, seed=1234, cache_dir=None, description="fake train", **kw):
    ids = np.arange(len(docs.sequence_lengths)) if ids is None else ids
    return GPTDataset(docs, ids, num_samples, seq, seed, cache_dir, description, **kw)


def _stream(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.documents.get(int(d)) for d in ds.document_index])


def _in_order(ds: GPTDataset) -> list[np.ndarray]:
    """Samples in stream order, undoing the shuffle index."""
    position = np.argsort(ds.shuffle_index)
    return [ds[int(p)] for p in position]


def test_samples_are_overlapping_windows_of_the_shuffled_stream():
    docs = _docs()
    ds = _dataset(docs, seq=16, num_samples=10)
    stream, seq = _stream(ds), 16
    assert sorted(ds.document_index) == list(range(40)), "one epoch: every document exactly once"
    assert len(ds) == (len(stream) - 1) // seq >= 10
    for j, sample in enumerate(_in_order(ds)):
        assert sample.dtype == np.int64 and len(sample) == seq + 1
        np.testing.assert_array_equal(sample, stream[j * seq: j * seq + seq + 1])
    assert len(stream) - (len(ds) * seq + 1) < seq, "only the final partial window is dropped"


def test_every_token_of_an_epoch_is_used_when_it_divides():
    seq = 8
    docs = FakeDocuments([5, 9, 3, 7, 10, 3, 4])  # 41 tokens = 5 * 8 + 1
    ds = _dataset(docs, num_samples=5, seq=seq)
    used = np.unique(np.concatenate([ds[i] for i in range(len(ds))]))
    np.testing.assert_array_equal(used, np.arange(41))


def _megatron_sample_index(lengths, document_index, seq, num_samples):
    """Megatron-LM's helpers.cpp build_sample_idx as a plain loop (add_extra_token = 1)."""
    rows, position, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq + 1
        while remaining:
            available = lengths[document_index[position]] - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


def test_sample_index_matches_megatron_loop():
    docs = FakeDocuments([3, 0, 17, 1, 1, 40, 2, 9, 0, 12, 5, 33])
    ds = _dataset(docs, num_samples=30, seq=7)
    expected = _megatron_sample_index(docs.sequence_lengths, ds.document_index, 7, len(ds))
    np.testing.assert_array_equal(ds.sample_index, expected)
    assert ds.sample_index.dtype == np.int32 and ds.document_index.dtype == np.int32
    document_index = np.array([1, 8, 0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11])  # starts with empty documents
    total = int(docs.sequence_lengths[document_index].sum())
    np.testing.assert_array_equal(gpt_dataset._sample_index(docs.sequence_lengths, document_index, 5, total),
                                  _megatron_sample_index(docs.sequence_lengths, document_index, 5, (total - 1) // 5))


def test_deterministic_for_a_seed_and_different_for_another():
    docs = _docs()
    a, b, c = _dataset(docs, seed=1), _dataset(docs, seed=1), _dataset(docs, seed=2)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


@pytest.mark.parametrize("extra, separate", [(0.1, True), (0.9, False)])
def test_multi_epoch(extra, separate):
    docs, seq = _docs(), 16
    per_epoch = (int(docs.sequence_lengths.sum()) - 1) // seq
    num_samples = int(2.0 * per_epoch + extra * per_epoch)
    ds = _dataset(docs, num_samples=num_samples, seq=seq)
    assert len(ds) >= num_samples
    np.testing.assert_array_equal(np.bincount(ds.document_index), np.full(40, 3))
    first_two = np.bincount(ds.document_index[:80], minlength=40)
    assert np.all(first_two == 2) == separate, "a small final epoch is shuffled on its own"
    before = (2 * int(docs.sequence_lengths.sum()) - 1) // seq
    assert (np.sort(ds.shuffle_index[:before]) == np.arange(before)).all() == separate
    stream = _stream(ds)
    for j, sample in enumerate(_in_order(ds)):
        np.testing.assert_array_equal(sample, stream[j * seq: j * seq + seq + 1])


def test_split_ids_are_the_only_documents_used():
    docs = _docs(100)
    train, valid, _ = split_documents(100, "80,20,0")
    ds = _dataset(docs, ids=valid, num_samples=50)
    assert set(np.unique(ds.document_index)) == set(valid)


def test_real_indexed_dataset(tmp_path):
    """Documents written as .bin/.idx (uint16, EOD appended) come back as the same windows."""
    eod, rng = 0, np.random.default_rng(3)
    documents = [np.append(rng.integers(1, 50_000, n), eod) for n in rng.integers(1, 40, 60)]
    with IndexedDatasetWriter(str(tmp_path / "corpus_text_document"), np.uint16) as writer:
        for tokens in documents:
            writer.add_document(tokens)
    corpus = IndexedDataset(str(tmp_path / "corpus_text_document"))
    train, _, _ = split_documents(len(corpus), "9,1,0")
    ds = GPTDataset(corpus, train, 30, 16, 5, str(tmp_path / "cache"), f"{tmp_path}/corpus train")
    stream = np.concatenate([documents[d] for d in ds.document_index])
    assert set(ds.document_index) == set(train)
    for j, sample in enumerate(_in_order(ds)):
        np.testing.assert_array_equal(sample, stream[j * 16: j * 16 + 17])
    assert (stream == eod).sum() == len(train), "every document ends with its EOD"


def _files(path) -> set[str]:
    return set(os.listdir(path))


def test_cache_hit_does_not_rebuild_and_gives_identical_samples(tmp_path, monkeypatch):
    docs, calls = _docs(), []
    uncached = _dataset(docs)
    built = _dataset(docs, cache_dir=str(tmp_path), barrier=lambda: calls.append("builder"))
    files = _files(tmp_path)
    assert len(files) == 4 and sum(f.endswith(".npy") for f in files) == 3 and not any(".tmp" in f for f in files)

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt on a cache hit")

    monkeypatch.setattr(gpt_dataset, "_build_indices", no_build)
    again = _dataset(docs, cache_dir=str(tmp_path), barrier=lambda: calls.append("builder"))
    other_rank = _dataset(docs, cache_dir=str(tmp_path), is_builder=False, barrier=lambda: calls.append("other"))
    assert calls == ["builder", "builder", "other"], "one barrier per rank, hit or miss"
    assert _files(tmp_path) == files
    assert isinstance(again.sample_index, np.memmap)
    for ds in (built, again, other_rank):
        assert len(ds) == len(uncached)
        for i in range(len(ds)):
            np.testing.assert_array_equal(ds[i], uncached[i])


def test_non_builder_without_cache_fails_loudly(tmp_path):
    with pytest.raises(FileNotFoundError, match="builder rank"):
        _dataset(_docs(), cache_dir=str(tmp_path), is_builder=False)


def test_cache_name_changes_with_every_input(tmp_path):
    docs = _docs()
    variants = [{}, {"description": "fake valid"}, {"seed": 7}, {"seq": 8}, {"num_samples": 21},
                {"ids": np.arange(39)}, {"docs": _docs(seed=1)}]
    stems = set()
    for variant in variants:
        before = _files(tmp_path)
        _dataset(variant.pop("docs", docs), cache_dir=str(tmp_path), **variant)
        new = _files(tmp_path) - before
        assert len(new) == 4, f"{variant} reused another variant's cache"
        stems |= {name.split("-")[0] for name in new}
    assert len(stems) == len(variants)


def test_bad_document_ids():
    with pytest.raises(ValueError, match="40 documents"):
        _dataset(_docs(), ids=np.array([0, 40]))
    with pytest.raises(ValueError, match="split empty"):
        _dataset(_docs(), ids=np.array([], dtype=np.int64))


def test_split_proportions():
    train, valid, test = split_documents(1000, "949,50,1")
    assert (len(train), len(valid), len(test)) == (949, 50, 1)
    np.testing.assert_array_equal(np.concatenate([train, valid, test]), np.arange(1000))
    assert [len(s) for s in split_documents(10, "1,0,0")] == [10, 0, 0]
    assert [len(s) for s in split_documents(10, "1")] == [10, 0, 0]
    assert [len(s) for s in split_documents(7, "0.9/0.05/0.05")] == [6, 1, 0]
    assert [len(s) for s in split_documents(3, "0,1,1")] == [0, 2, 1]


@pytest.mark.parametrize("bad", ["", "a,b", "1,2,3,4", "-1,1,1", "0,0,0", "nan,1,1", "1,,1"])
def test_bad_split_strings(bad):
    with pytest.raises(ValueError, match="949,50,1"):
        split_documents(100, bad)
