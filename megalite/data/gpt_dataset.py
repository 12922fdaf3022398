"""GPT pretraining samples over a tokenized corpus, with the three indices Megatron-LM uses.

A sample is seq_length + 1 consecutive tokens of the shuffled stream of documents (inputs
and labels shifted by one); documents already end with EOD (preprocessing's --append-eod),
so samples simply run across document boundaries. Three indices make random access cheap:

- document index: the split's document ids, repeated for as many epochs as num_samples needs,
  shuffled with the seed;
- sample index: for every sample start, (position in the document index, token offset);
  row i + 1 is where sample i ends, so consecutive samples share one token;
- shuffle index: a permutation of the samples.

They are built with numpy (cumsum + searchsorted, no per-sample Python), cached as .npy files
named by a hash of everything that determines them, built once by the builder rank and
memory-mapped by every rank. Given the same document ids, seed, seq_length and num_samples,
they equal Megatron-LM's (same RandomState calls, same sample-index rule).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megalite.errors import InvalidInput

INDEX_FORMAT_VERSION = 1
FINAL_EPOCH_THRESHOLD = 0.8  # Megatron's: a final epoch giving < 80% of an epoch's samples is shuffled alone
SAMPLE_CHUNK = 1 << 22  # sample starts located per searchsorted call, to bound temporary memory
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


class TokenDocuments(Protocol):
    """What the dataset needs from a tokenized corpus (megalite.data.indexed_dataset provides it).

    A "document" here is one sequence of the .idx file; without --split-sentences the two agree.
    """

    sequence_lengths: np.ndarray

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def split_documents(num_documents: int, split: str) -> list[np.ndarray]:
    """Contiguous train/valid/test document-id ranges from weights such as "949,50,1".

    Bounds are round(cumulative normalised weight * num_documents), so the ranges tile the
    corpus without gaps and never go negative; exactly Megatron-Core's (its split matrix: the
    weights normalised, then summed in order, in float64, each bound rounded half to even), also
    where a bound falls on a half and the order of those float operations decides it.
    """
    weights = _parse_split(split)
    bounds = [0, *np.rint(np.cumsum(weights / np.sum(weights)) * num_documents).astype(np.int64)]
    bounds[-1] = num_documents
    dtype = _index_dtype(num_documents)
    return [np.arange(lo, hi, dtype=dtype) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _parse_split(split: str) -> np.ndarray:
    parts = str(split).replace("/", ",").split(",")
    hint = f"bad split {split!r}: expected up to three non-negative numbers separated by commas, e.g. '949,50,1'"
    try:
        weights = np.array([float(p) for p in parts], dtype=np.float64)
    except ValueError:
        raise ValueError(hint) from None
    if len(weights) > 3 or not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError(hint)
    return np.concatenate([weights, np.zeros(3 - len(weights))])


def _index_dtype(n: int) -> type:
    """int32 for indices below 2**31, as Megatron stores them, halving memory and disk."""
    return np.int32 if n <= np.iinfo(np.int32).max else np.int64


class GPTDataset:
    """Samples of seq_length + 1 int64 tokens drawn from `document_ids` of `documents`.

    With cache_dir, the builder rank (is_builder) builds the indices unless the cache already
    has them, then every rank calls barrier() once and memory-maps the files; without cache_dir
    each rank builds them in memory. `description` names the corpus and split (include the
    dataset path) and goes into the cache key.
    """

    def __init__(self, documents: TokenDocuments, document_ids: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, cache_dir: str | None, description: str, is_builder: bool = True,
                 barrier: Callable[[], None] | None = None, vocabulary: Vocabulary | None = None) -> None:
        if seq_length < 1 or num_samples < 0:
            raise ValueError(f"{description}: need seq_length >= 1 and num_samples >= 0, "
                             f"got {seq_length} and {num_samples}")
        self.documents, self.seq_length, self.description = documents, seq_length, description
        self.vocabulary = vocabulary
        lengths = np.asarray(documents.sequence_lengths)
        ids = _check_document_ids(document_ids, len(lengths), description)
        build = lambda: _build_indices(lengths, ids, num_samples, seq_length, seed, description)  # noqa: E731
        if cache_dir is None:
            indices = build()
        else:
            key = {"class": "GPTDataset", "format_version": INDEX_FORMAT_VERSION, "description": description,
                   **_corpus_fingerprint(lengths, ids), "num_samples": num_samples, "seq_length": seq_length,
                   "seed": seed}
            indices = _cached_indices(cache_dir, key, build, is_builder, barrier)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self.description} ({len(self)} samples)")
        j = int(self.shuffle_index[i])
        first, first_offset = (int(x) for x in self.sample_index[j])
        last, last_offset = (int(x) for x in self.sample_index[j + 1])
        doc = lambda position: int(self.document_index[position])  # noqa: E731
        if first == last:
            parts = [self.documents.get(doc(first), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [self.documents.get(doc(first), first_offset)]
            parts += [self.documents.get(doc(p)) for p in range(first + 1, last)]
            parts.append(self.documents.get(doc(last), 0, last_offset + 1))
        sample = np.concatenate(parts, dtype=np.int64)
        if self.vocabulary is not None:
            self.vocabulary.check(sample, f"{self.description}, sample {i}")
        return sample


@dataclass(frozen=True)
class Vocabulary:
    """The ids a model embeds, and the tokenizer they come from (for messages). Every sample is checked as it is
    read (in the loader's worker, on the host: one max over a few thousand ids), so a corpus made with
    another tokenizer stops the run with a line naming the dataset and the vocabulary instead of failing inside
    the embedding (an IndexError on a CPU, a device-side assert on a GPU)."""

    size: int
    tokenizer: str

    def check(self, tokens: np.ndarray, where: str) -> None:
        """One pass over `tokens` (int64): viewed unsigned, a negative id is larger than any vocabulary."""
        if tokens.size and tokens.view(np.uint64).max() >= self.size:
            bad = int(tokens[(tokens < 0) | (tokens >= self.size)][0])
            raise TokenOutOfVocabulary(
                f"{where} holds token id {bad}, outside the vocabulary of {self.size} ids of {self.tokenizer}: "
                "the corpus was tokenized with another tokenizer; preprocess it with this one, or train with the "
                "one it was made with")


class TokenOutOfVocabulary(InvalidInput):
    """A corpus whose token ids the model's vocabulary does not hold."""


def _check_document_ids(document_ids: np.ndarray, num_documents: int, description: str) -> np.ndarray:
    ids = np.asarray(document_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{description}: document_ids must be a non-empty 1-D integer array, "
                         f"got shape {ids.shape} dtype {ids.dtype} (is the split empty?)")
    if ids.min() < 0 or ids.max() >= num_documents:
        raise ValueError(f"{description}: document_ids span [{ids.min()}, {ids.max()}] but the corpus "
                         f"has {num_documents} documents")
    return np.ascontiguousarray(ids, dtype=_index_dtype(num_documents))


def _corpus_fingerprint(lengths: np.ndarray, ids: np.ndarray) -> dict:
    """Everything about the corpus the indices depend on. Hashing all lengths (not only their
    count and sum) means a re-tokenized corpus at the same path never reuses stale indices."""
    return {"num_documents": len(lengths), "num_tokens": int(lengths.sum(dtype=np.int64)),
            "sequence_lengths_sha256": _sha256(lengths.astype(np.int32, copy=False)),
            "num_split_documents": len(ids), "document_ids_sha256": _sha256(ids)}


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).hexdigest()


def _cached_indices(cache_dir: str, key: dict, build: Callable[[], tuple], is_builder: bool,
                    barrier: Callable[[], None] | None) -> tuple[np.ndarray, ...]:
    """Build-or-load with one barrier per rank, whatever the cache holds.

    The JSON is renamed into place last, so its presence means all three .npy files are
    complete; a crash mid-write leaves only temporaries or a JSON-less set that is rebuilt.
    """
    stem = os.path.join(cache_dir, hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16])
    paths = {name: f"{stem}-GPTDataset-{name}.npy" for name in INDEX_NAMES}
    info_path = f"{stem}-GPTDataset-description.json"
    if is_builder:
        try:
            if not os.path.isfile(info_path):
                _save(build(), key, paths, info_path)
        finally:
            if barrier is not None:
                barrier()
    else:
        if barrier is not None:
            barrier()
        if not os.path.isfile(info_path):
            raise FileNotFoundError(f"{key['description']}: no cached indices at {info_path}; the builder rank "
                                    f"(is_builder=True) must build them before the barrier")
    return tuple(np.load(paths[name], mmap_mode="r") for name in INDEX_NAMES)


def _save(indices: tuple[np.ndarray, ...], key: dict, paths: dict[str, str], info_path: str) -> None:
    os.makedirs(os.path.dirname(info_path) or ".", exist_ok=True)
    for name, array in zip(INDEX_NAMES, indices):
        _write_atomic(paths[name], lambda f, a=array: np.save(f, a))
    shapes = {name: {"shape": list(a.shape), "dtype": str(a.dtype), "file": os.path.basename(paths[name])}
              for name, a in zip(INDEX_NAMES, indices)}
    info = {**key, "num_samples_available": len(indices[2]), "indices": shapes}
    _write_atomic(info_path, lambda f: f.write(json.dumps(info, indent=2).encode()))


def _write_atomic(path: str, write: Callable) -> None:
    """Write to a unique temporary beside `path`, fsync, then rename: readers never see half a file."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_indices(lengths: np.ndarray, ids: np.ndarray, num_samples: int, seq_length: int, seed: int,
                   description: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three indices, drawing from one RandomState in Megatron-LM's order."""
    tokens_per_epoch = int(lengths[ids].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"{description}: the split's {len(ids)} documents hold no tokens")
    num_epochs, samples_before_final = _plan(tokens_per_epoch, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    document_index = np.tile(ids, num_epochs)
    _shuffle(rng, document_index, len(ids) * (num_epochs - 1) if samples_before_final is not None else None)
    sample_index = _sample_index(lengths, document_index, seq_length, num_epochs * tokens_per_epoch)
    total = len(sample_index) - 1
    shuffle_index = np.arange(total, dtype=np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64)
    _shuffle(rng, shuffle_index, samples_before_final)
    return document_index, sample_index, shuffle_index


def _plan(tokens_per_epoch: int, num_samples: int, seq_length: int) -> tuple[int, int | None]:
    """(epochs, samples in all but the final epoch if that epoch is shuffled on its own, else None).

    A final epoch used only in small part is kept apart so that the full epochs before it
    are each seen exactly once, rather than mixing in a few documents a third time.
    """
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    if num_epochs == 1:
        return 1, None
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate = num_samples - samples_before_final < int(FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    return num_epochs, samples_before_final if separate else None


def _shuffle(rng: np.random.RandomState, array: np.ndarray, split: int | None) -> None:
    """Shuffle in place, [0, split) and [split, end) separately when split is given."""
    if split is None:
        rng.shuffle(array)
    else:
        rng.shuffle(array[:split])
        rng.shuffle(array[split:])


def _sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_length: int, total_tokens: int) -> np.ndarray:
    """Row i = (document-index position, offset) of token i * seq_length of the shuffled stream.

    Sample i spans rows i..i+1 inclusive: seq_length + 1 tokens, its last token being the
    next sample's first. Zero-length documents are skipped (searchsorted side="right").
    """
    starts_in_stream = np.zeros(len(document_index) + 1, dtype=np.int64)
    np.cumsum(lengths[document_index], dtype=np.int64, out=starts_in_stream[1:])
    num_rows = (total_tokens - 1) // seq_length + 1
    out = np.empty((num_rows, 2), dtype=_index_dtype(len(document_index)))
    for begin in range(0, num_rows, SAMPLE_CHUNK):
        token = np.arange(begin, min(begin + SAMPLE_CHUNK, num_rows), dtype=np.int64) * seq_length
        position = np.searchsorted(starts_in_stream, token, side="right") - 1
        out[begin:begin + len(token), 0] = position
        out[begin:begin + len(token), 1] = token - starts_in_stream[position]
    out[0] = 0  # Megatron's first row, even when the first document is empty
    return out
