"""Worker side of tools/preprocess_data.py: raw input chunk in, compact token arrays out.

The parent only reads bytes and writes arrays; everything per document happens here, in
parallel: UTF-8 decoding, JSON parsing, validation, batch tokenization and the conversion to
numpy. A chunk's result is a few flat arrays per key (tokens of all its documents back to
back, one length per document), so what crosses the process boundary is small and pickles
at memcpy speed.

Bad records never raise: each becomes a `Reject` naming its file, line and reason, and the
record is dropped for every key, so the datasets of several `--json-keys` stay aligned
document for document.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from megalite.data.indexed_dataset import optimal_dtype
from megalite.data.tokenizers import Tokenizer, build_tokenizer

# Why a record is skipped; the summary and the rejects file count by these names.
MALFORMED_JSON = "malformed_json"
NOT_OBJECT = "not_object"
MISSING_KEY = "missing_key"
NOT_STRING = "not_string"
EMPTY_TEXT = "empty_text"
INVALID_UTF8 = "invalid_utf8"
UNENCODABLE = "unencodable"


class Missing(enum.Enum):
    """The value of a key a record lacks: unlike None (JSON null, Arrow null) it is not a
    value, and unlike object() it survives pickling between processes as the same object."""

    KEY = 0


@dataclass
class Chunk:
    """A unit of work, in input order. `records` depends on `kind`:

    "jsonl": raw bytes of whole lines, `first` = 1-based number of the first line;
    "columns": {key: values} from Parquet or a Hugging Face dataset, Missing.KEY values for
        a column the input lacks, `first` = 1-based number of the first row;
    "text": paths of plain-text files, one document each, `first` unused (0).
    """

    source: str
    kind: str
    records: bytes | dict[str, list] | list[str]
    first: int = 0
    size: int = 0  # input bytes, for progress and throughput
    columns: list[str] | None = None  # "columns": every column of the source, to name them when a key is missing
    read_to: int = 0  # on-disk bytes of all inputs read once this chunk was cut (the percentage done)


@dataclass
class Reject:
    """A skipped record: where it is and why (one of the reason names above)."""

    source: str
    line: int | None  # line (JSONL) or row (Parquet / Hugging Face); None for a whole text file
    reason: str
    detail: str = ""
    key: str | None = None


@dataclass
class ChunkResult:
    """Per key: the tokens of every kept document back to back, and each one's length."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    rejects: list[Reject] = field(default_factory=list)
    size: int = 0
    keys_seen: set[str] = field(default_factory=set)  # the keys of records that lack one of --json-keys


@dataclass
class WorkerConfig:
    """What a worker needs to build its own tokenizer from the files: a few strings pickle
    cheaply under any start method (fork, spawn, forkserver), a loaded tokenizer may not."""

    tokenizer_type: str
    json_keys: list[str]
    append_eod: bool
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None

    def build_tokenizer(self) -> Tokenizer:
        return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file, merge_file=self.merge_file,
                               tokenizer_model=self.tokenizer_model, vocab_size=self.vocab_size)


class _Worker:
    """One per process: the tokenizer is built once, not once per chunk."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.tokenizer = config.build_tokenizer()
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)


_worker: _Worker | None = None  # process-local, set by init_worker: a pool initializer has nowhere else to put it


def init_worker(config: WorkerConfig) -> None:
    """Pool initializer. The parent owns interruption (it aborts the outputs and stops the
    workers), so workers ignore Ctrl-C and die plainly on SIGTERM (not through a handler
    inherited from the parent by fork); each worker is one core, so tokenizers must not
    start their own thread pools on top."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = _Worker(config)


def encode_chunk(chunk: Chunk) -> ChunkResult:
    """Pool task: parse, validate and tokenize one chunk (init_worker must have run)."""
    assert _worker is not None, "encode_chunk runs in a worker started with init_worker"
    return _process(_worker, chunk)


def _process(worker: _Worker, chunk: Chunk) -> ChunkResult:
    """Records -> validated texts -> ids per key -> flat arrays; rejects in input order."""
    keys = worker.config.json_keys
    rejects: list[tuple[int, Reject]] = []
    kept, texts, seen = [], {key: [] for key in keys}, set()
    for position, record in enumerate(_records(chunk, keys, seen)):
        checked = record if isinstance(record, Reject) else _check(record, keys)
        if isinstance(checked, Reject):
            rejects.append((position, checked))
            continue
        kept.append((position, record[0], record[1]))
        for key, text in zip(keys, checked):
            texts[key].append(text)
    ids = {key: _encode(worker.tokenizer, texts[key]) for key in keys}
    rejects += _drop_unusable(ids, keys, kept)
    eod = worker.tokenizer.eod if worker.config.append_eod else None
    tokens, lengths = {}, {}
    for key in keys:
        tokens[key], lengths[key] = _flatten(ids[key], worker.dtype, eod)
    if any(reject.reason == MISSING_KEY for _, reject in rejects) and chunk.columns is not None:
        seen.update(chunk.columns)
    return ChunkResult(tokens, lengths, [reject for _, reject in sorted(rejects, key=lambda r: r[0])], chunk.size,
                       seen)


def _records(chunk: Chunk, keys: list[str], seen: set[str]) -> Iterator[tuple[str, int | None, list] | Reject]:
    """(source, line, [value per key]) for each record, or a Reject if it does not parse; the keys of JSON
    records that lack one of `keys` are added to `seen`."""
    if chunk.kind == "jsonl":
        yield from _jsonl_records(chunk, keys, seen)
    elif chunk.kind == "columns":
        columns = [chunk.records[key] for key in keys]
        for row, values in enumerate(zip(*columns), start=chunk.first):
            yield chunk.source, row, list(values)
    else:
        for path in chunk.records:
            with open(path, "rb") as f:
                yield path, None, [f.read()]


def _jsonl_records(chunk: Chunk, keys: list[str], seen: set[str]) -> Iterator[tuple[str, int, list] | Reject]:
    """Decoding the whole chunk at once is the fast path; only a chunk holding invalid
    UTF-8 is decoded line by line, to find and skip exactly the bad lines."""
    try:
        lines = chunk.records.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = chunk.records.split(b"\n")
    for number, line in enumerate(lines, start=chunk.first):
        if not line or line.isspace():  # blank lines (a trailing one is common) are not records
            continue
        try:
            record = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
        except UnicodeDecodeError as error:
            yield Reject(chunk.source, number, INVALID_UTF8, str(error))
        except (ValueError, RecursionError) as error:
            yield Reject(chunk.source, number, MALFORMED_JSON, str(error))
        else:
            if isinstance(record, dict):
                values = [record.get(key, Missing.KEY) for key in keys]
                if Missing.KEY in values:
                    seen.update(record)
                yield chunk.source, number, values
            else:
                yield Reject(chunk.source, number, NOT_OBJECT, f"a JSON {type(record).__name__}, not an object")


def _check(record: tuple[str, int | None, list], keys: list[str]) -> list[str] | Reject:
    """The texts of one record, or why it is skipped. Arrow string columns and text files
    arrive as bytes, so invalid UTF-8 is caught here for every input format."""
    source, line, values = record
    texts = []
    for key, value in zip(keys, values):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as error:
                return Reject(source, line, INVALID_UTF8, str(error), key)
        if value is Missing.KEY:
            return Reject(source, line, MISSING_KEY, f"no {key!r}", key)
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            return Reject(source, line, NOT_STRING, f"{key!r} is {kind}, not a string", key)
        if not value:
            return Reject(source, line, EMPTY_TEXT, f"{key!r} is empty", key)
        texts.append(value)
    return texts


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list[list[int] | Exception]:
    """Batch-encode; if the batch fails (e.g. a lone surrogate from a JSON \\ud800 escape),
    encode one by one so only the offending documents are lost."""
    try:
        return tokenizer.encode_batch(texts)
    except Exception:  # noqa: BLE001 - any tokenizer error; the per-text pass reports it
        out: list[list[int] | Exception] = []
        for text in texts:
            try:
                out.append(tokenizer.encode(text))
            except Exception as error:  # noqa: BLE001
                out.append(error)
        return out


def _drop_unusable(ids: dict[str, list], keys: list[str], kept: list[tuple]) -> list[tuple[int, Reject]]:
    """Remove, for every key, the documents whose text of some key failed to encode or gave
    no tokens (e.g. whitespace for some SentencePiece models); return their rejects."""
    bad: dict[int, tuple[int, Reject]] = {}
    for key in keys:
        for i, doc in enumerate(ids[key]):
            if i in bad:
                continue
            position, source, line = kept[i]
            if isinstance(doc, Exception):
                bad[i] = position, Reject(source, line, UNENCODABLE, f"{key!r}: {type(doc).__name__}: {doc}", key)
            elif not doc:
                bad[i] = position, Reject(source, line, EMPTY_TEXT, f"{key!r} gives no tokens", key)
    if bad:
        for key in keys:
            ids[key] = [doc for i, doc in enumerate(ids[key]) if i not in bad]
    return list(bad.values())


def _flatten(docs: list[list[int]], dtype: type[np.number], eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Documents back to back in one array (eod after each, if given), without a Python loop per token."""
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
    if eod is not None:
        tokens = np.insert(tokens, np.cumsum(lengths), eod)
        lengths += 1
    return tokens, lengths
