"""The Megatron-LM .bin/.idx format, byte for byte, and the reader's refusal of bad pairs.

Expected bytes are built here field by field with struct, from the format's description,
not from our writer, so a layout slip in the writer cannot hide behind a matching reader.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    merge_datasets,
    optimal_dtype,
)

DOCS = {np.uint16: [[1, 300, 65499], [7], [42, 0]], np.int32: [[1, 70000, 2**31 - 1], [7], [42, 0]]}


def expected_idx(code: int, lengths: list[int], itemsize: int, doc_indices: list[int]) -> bytes:
    pointers = [itemsize * sum(lengths[:i]) for i in range(len(lengths))]
    return b"".join([
        b"MMIDIDX\x00\x00",
        struct.pack("<Q", 1),
        struct.pack("<B", code),
        struct.pack("<Q", len(lengths)),
        struct.pack("<Q", len(doc_indices)),
        *(struct.pack("<i", n) for n in lengths),
        *(struct.pack("<q", p) for p in pointers),
        *(struct.pack("<q", d) for d in doc_indices),
    ])


def write(prefix: Path, docs: list, dtype=np.uint16) -> str:
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


def files(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


@pytest.mark.parametrize("dtype,code,fmt", [(np.uint16, 8, "<H"), (np.int32, 4, "<i")])
def test_exact_bytes(tmp_path, dtype, code, fmt):
    docs = DOCS[dtype]
    bin_bytes, idx_bytes = files(write(tmp_path / "d", docs, dtype))
    assert idx_bytes == expected_idx(code, [3, 1, 2], struct.calcsize(fmt), [0, 1, 2, 3])
    assert len(idx_bytes) == 34 + 12 * 3 + 8 * 4
    assert bin_bytes == b"".join(struct.pack(fmt, t) for doc in docs for t in doc)


def test_add_documents_equals_add_document(tmp_path):
    docs = [np.arange(n, dtype=np.int64) for n in (5, 0, 3)] + [[9, 8]]
    with IndexedDatasetWriter(str(tmp_path / "batched"), np.uint16) as writer:
        writer.add_documents(docs[:2])
        writer.add_documents(docs[2:])
    assert files(str(tmp_path / "batched")) == files(write(tmp_path / "single", docs))


def test_round_trip_and_get(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=n) for n in rng.integers(0, 40, size=100)]
    dataset = IndexedDataset(write(tmp_path / "d", docs))
    assert len(dataset) == 100 and dataset.dtype is np.uint16
    assert dataset.num_tokens == sum(len(d) for d in docs)
    assert dataset.sequence_lengths.tolist() == [len(d) for d in docs]
    assert dataset.document_indices.tolist() == list(range(101))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(dataset[i], doc)
    longest = int(np.argmax(dataset.sequence_lengths))
    np.testing.assert_array_equal(dataset.get(longest, offset=2, length=5), docs[longest][2:7])
    np.testing.assert_array_equal(dataset.get(longest, offset=3), docs[longest][3:])
    np.testing.assert_array_equal(dataset[-1], docs[-1])
    with pytest.raises(IndexError, match="out of range"):
        dataset.get(longest, offset=1, length=len(docs[longest]))
    with pytest.raises(IndexError, match="sequence 100 out of range"):
        dataset[100]


def test_writer_refuses_tokens_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 65536\] do not fit uint16"):
        write(tmp_path / "d", [[0, 65536]])
    with pytest.raises(ValueError, match="must be integers"):
        write(tmp_path / "d", [[1.5]])
    assert os.listdir(tmp_path) == []


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, drop: int) -> None:
    os.truncate(path, os.path.getsize(path) - drop)


N = 3  # sequences in the dataset the corruptions below start from
CORRUPTIONS = {
    "truncated bin": (lambda p: _truncate(p + ".bin", 2), r"d\.bin is 10 bytes but .*d\.idx describes 12: truncated"),
    "truncated idx": (
        lambda p: _truncate(p + ".idx", 8),
        r"d\.idx is 94 bytes but its header \(3 sequences, 4 document indices\) implies 102",
    ),
    "bad magic": (lambda p: _patch(p + ".idx", 0, b"TNTIDX"), r"d\.idx starts with b'TNTIDX.*not a Megatron mmap"),
    "bad version": (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), r"d\.idx has version 2"),
    "unknown dtype code": (lambda p: _patch(p + ".idx", 17, b"\x09"), r"d\.idx has dtype code 9"),
    "wrong dtype code": (
        lambda p: _patch(p + ".idx", 17, b"\x04"),
        r"d\.idx: sequence 1 points at byte 6 but .* put it at 12 with 4-byte int32 tokens",
    ),
    "inconsistent pointers": (
        lambda p: _patch(p + ".idx", 34 + 4 * N + 8, struct.pack("<q", 4)),
        r"d\.idx: sequence 1 points at byte 4 but the lengths before it put it at 6 with 2-byte uint16",
    ),
    "decreasing document indices": (
        lambda p: _patch(p + ".idx", 34 + 12 * N + 8, struct.pack("<q", 2) + struct.pack("<q", 1)),
        r"d\.idx: document indices decrease at position 2",
    ),
    "document indices not ending at N": (
        lambda p: _patch(p + ".idx", 34 + 12 * N + 24, struct.pack("<q", 2)), r"document indices must run from 0 to 3"
    ),
    "missing bin": (lambda p: os.remove(p + ".bin"), r"d\.bin not found"),
    "missing idx": (lambda p: os.remove(p + ".idx"), r"d\.idx not found"),
}


@pytest.mark.parametrize("corrupt,message", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_reader_rejects(tmp_path, corrupt, message):
    prefix = write(tmp_path / "d", DOCS[np.uint16])
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(prefix)


def test_writer_is_atomic(tmp_path):
    with pytest.raises(RuntimeError, match="interrupted"):
        with IndexedDatasetWriter(str(tmp_path / "d"), np.uint16) as writer:
            writer.add_document([1, 2, 3])
            assert os.listdir(tmp_path) == [f"d.bin.tmp-{os.getpid()}"]
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    with IndexedDatasetWriter(str(tmp_path / "d"), np.uint16) as writer:
        writer.add_document([1, 2, 3])
        writer.finalize()  # explicit finalize inside the block: the exit must not finalize again
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def _megatron_sentence_split_dataset(prefix: str) -> str:
    """What Megatron writes with --split-sentences: document 0 is two sequences, document 1 one."""
    Path(prefix + ".bin").write_bytes(struct.pack("<5H", 10, 11, 12, 13, 14))
    Path(prefix + ".idx").write_bytes(expected_idx(8, [2, 1, 2], 2, [0, 2, 3]))
    return prefix


def test_merge_equals_writing_everything_once(tmp_path):
    parts = [[[1, 2, 3], [4]], [[5]], [[6, 7], [], [8, 9, 10]]]
    prefixes = [write(tmp_path / f"part{i}", docs) for i, docs in enumerate(parts)]
    merge_datasets(prefixes, str(tmp_path / "merged"))
    assert files(str(tmp_path / "merged")) == files(write(tmp_path / "whole", [d for docs in parts for d in docs]))


def test_merge_keeps_document_boundaries(tmp_path):
    prefixes = [write(tmp_path / "a", [[1], [2, 3]]), _megatron_sentence_split_dataset(str(tmp_path / "b"))]
    merge_datasets(prefixes, str(tmp_path / "m"))
    merged = IndexedDataset(str(tmp_path / "m"))
    assert merged.document_indices.tolist() == [0, 1, 2, 4, 5]
    assert [merged[i].tolist() for i in range(len(merged))] == [[1], [2, 3], [10, 11], [12], [13, 14]]


def test_merge_refuses_mixed_dtypes(tmp_path):
    prefixes = [write(tmp_path / "small", [[1]]), write(tmp_path / "large", [[1]], np.int32)]
    with pytest.raises(IndexedDatasetError, match=r"large\.idx holds int32 tokens but .*small\.idx holds uint16"):
        merge_datasets(prefixes, str(tmp_path / "m"))
    assert not list(tmp_path.glob("m*"))


def test_merge_cli(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("merge_tool", Path(__file__).parents[1] / "tools/merge_datasets.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = [[[3, 4]], [[1], [2]], [[5, 6, 7]]]
    for name, docs in zip(["b", "a", "c"], parts):
        write(shards / name, docs)
    whole = files(write(tmp_path / "whole", parts[1] + parts[0] + parts[2]))  # directory order is sorted: a, b, c
    tool.main(["--input", str(shards), "--output-prefix", str(shards / "merged")])
    assert files(str(shards / "merged")) == whole
    summary = capsys.readouterr().out
    assert (summary.count("\n") == 1 and "merged 3 datasets" in summary
            and "4 documents, 4 sequences, 7 uint16 tokens" in summary)
    tool.main(["--input", str(shards), "--output-prefix", str(shards / "merged")])  # a re-run skips its own output
    assert files(str(shards / "merged")) == whole
    tool.main(["--input", str(shards / "a"), str(shards / "b.idx"), str(shards / "c"),
               "--output-prefix", str(tmp_path / "p")])
    assert files(str(tmp_path / "p")) == whole
    with pytest.raises(SystemExit, match="1"):
        tool.main(["--input", str(shards / "a"), str(tmp_path / "nowhere"), "--output-prefix", str(tmp_path / "q")])
    assert "nowhere.idx not found" in capsys.readouterr().err


def test_optimal_dtype_boundary():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(50257) is np.uint16 and optimal_dtype(128256) is np.int32
