"""Input side of tools/preprocess_data.py: files, folders and globs -> ordered work chunks.

The parent process only cuts inputs into chunks of about CHUNK_BYTES; it never parses a
record, so it stays far from being the bottleneck. JSONL chunks are raw bytes cut at line
ends (the workers decode and parse them); Parquet and Hugging Face datasets are read in
Arrow batches of about the same size, so memory stays bounded however large the corpus is.
"""

from __future__ import annotations

import glob
import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass

from megalite.data.preprocess import Chunk, Missing

FORMATS = ("auto", "jsonl", "parquet", "text", "hf")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl", ".json.gz": "jsonl",
             ".parquet": "parquet", ".txt": "text"}
# Per-chunk costs (a pipe round trip, pickling, the parent's write) are about a millisecond,
# against ~0.2 s of tokenizing per worker for 512 KB; smaller chunks shorten the end of a run,
# where one worker finishes the last chunk while the others idle.
CHUNK_BYTES = 1 << 19
_STREAMING_ROWS = 1024  # rows per batch when a streamed dataset's row size is unknown


class InputError(ValueError):
    """An input that cannot be read as asked; the message names it and the fix."""


@dataclass
class Source:
    path: str
    format: str  # one of FORMATS but "auto"


def _format_of(path: str) -> str | None:
    name = path.lower()
    return next((fmt for suffix, fmt in _SUFFIXES.items() if name.endswith(suffix)), None)


def is_saved_dataset(path: str) -> bool:
    """A folder written by Dataset.save_to_disk (state.json) or DatasetDict.save_to_disk."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def expand_inputs(inputs: list[str], input_format: str) -> tuple[list[Source], list[str]]:
    """(sources in processing order, files of folders skipped for an unknown suffix).

    Each entry is a file, a folder (walked recursively in sorted order, hidden entries
    skipped) or a glob; a folder saved by `datasets` is one Hugging Face source.
    """
    sources: list[Source] = []
    skipped: list[str] = []
    for entry in inputs:
        paths = [entry] if os.path.exists(entry) else sorted(glob.glob(entry, recursive=True))
        if not paths:
            raise InputError(f"--input {entry}: no such file or folder, and no glob match")
        for path in paths:
            if os.path.isdir(path) and (input_format == "hf" or (input_format == "auto" and is_saved_dataset(path))):
                sources.append(Source(path, "hf"))
            elif os.path.isdir(path):
                _expand_folder(path, input_format, sources, skipped)
            else:
                fmt = input_format if input_format != "auto" else _format_of(path)
                if fmt is None:
                    raise InputError(f"--input {path}: unknown suffix (known: {', '.join(_SUFFIXES)}); "
                                     "name the format with --input-format")
                sources.append(Source(path, fmt))
    return sources, skipped


def _expand_folder(folder: str, input_format: str, sources: list[Source], skipped: list[str]) -> None:
    """Files in sorted walk order; a saved Hugging Face dataset inside is one source (its
    state.json and dataset_info.json are not JSONL)."""
    for root, dirs, names in os.walk(folder):
        if input_format == "auto" and root != folder and is_saved_dataset(root):
            sources.append(Source(root, "hf"))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(root, name)
            fmt = input_format if input_format != "auto" else _format_of(path)
            if fmt is None:
                skipped.append(path)
            else:
                sources.append(Source(path, fmt))


def disk_bytes(source: Source) -> int:
    """What `source` takes on disk (a Hugging Face folder: all its files): the measure of progress, the same
    for every format (0 for a named pipe)."""
    if os.path.isdir(source.path):
        return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(source.path)
                   for name in names)
    return os.path.getsize(source.path)


def read_chunks(sources: list[Source], keys: list[str], hf_split: str | None = None) -> Iterator[Chunk]:
    """Every source's records as chunks, in order; consecutive text files share chunks. Each chunk's `read_to`
    counts the on-disk bytes of the sources before its own plus how far into its own it reaches."""
    texts: list[str] = []
    size = done = 0
    for source in sources:
        on_disk = disk_bytes(source)
        if source.format == "text":
            texts.append(source.path)
            size, done = size + on_disk, done + on_disk
            if size >= CHUNK_BYTES:
                yield Chunk(texts[0], "text", texts, size=size, read_to=done)
                texts, size = [], 0
            continue
        if texts:
            yield Chunk(texts[0], "text", texts, size=size, read_to=done)
            texts, size = [], 0
        if source.format == "jsonl":
            chunks = _jsonl_chunks(source.path)
        elif source.format == "parquet":
            chunks = _parquet_chunks(source.path, keys, on_disk)
        else:
            chunks = _hf_chunks(source.path, keys, hf_split, on_disk)
        for chunk in chunks:
            chunk.read_to = done + min(chunk.read_to, on_disk)
            yield chunk
        done += on_disk
    if texts:
        yield Chunk(texts[0], "text", texts, size=size, read_to=done)


def _jsonl_chunks(path: str) -> Iterator[Chunk]:
    """Raw bytes of whole lines, gunzipped on the fly for .gz; each chunk knows its first line and how far into
    the file on disk it reaches (for .gz, the compressed bytes read so far)."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    line, read = 1, 0
    with opener(path, "rb") as f:
        compressed = f.fileobj if isinstance(f, gzip.GzipFile) and f.fileobj.seekable() else None
        while data := f.read(CHUNK_BYTES):
            if not data.endswith(b"\n"):
                data += f.readline()
            read = compressed.tell() if compressed is not None else read + len(data)
            yield Chunk(path, "jsonl", data, first=line, size=len(data), read_to=read)
            line += data.count(b"\n")


def _columns_chunk(source: str, table, keys: list[str], first: int, columns: list[str], read_to: int) -> Chunk:
    """An Arrow batch as plain lists per key. Strings travel as bytes (a zero-copy cast), so
    a row of invalid UTF-8 is rejected by the worker instead of failing the whole batch here."""
    import pyarrow as pa

    records = {}
    for key in keys:
        if key not in table.column_names:
            records[key] = [Missing.KEY] * table.num_rows
            continue
        column = table.column(key)
        if pa.types.is_string(column.type):
            column = column.cast(pa.binary())
        elif pa.types.is_large_string(column.type):
            column = column.cast(pa.large_binary())
        records[key] = column.to_pylist()
    return Chunk(source, "columns", records, first=first, size=table.nbytes, columns=columns, read_to=read_to)


def _rows_per_chunk(bytes_per_row: float) -> int:
    return max(1, int(CHUNK_BYTES / max(bytes_per_row, 1.0)))


def _parquet_chunks(path: str, keys: list[str], on_disk: int) -> Iterator[Chunk]:
    """Batches of the key columns only, sized from the footer's uncompressed column sizes; progress by rows."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    present = [key for key in keys if key in file.schema_arrow.names]
    meta = file.metadata
    size = sum(meta.row_group(g).column(c).total_uncompressed_size for g in range(meta.num_row_groups)
               for c in range(meta.num_columns) if meta.schema.column(c).path.split(".")[0] in present)
    first = 1
    for batch in file.iter_batches(batch_size=_rows_per_chunk(size / max(meta.num_rows, 1)), columns=present):
        yield _columns_chunk(path, batch, keys, first, file.schema_arrow.names,
                             on_disk * (first - 1 + batch.num_rows) // max(meta.num_rows, 1))
        first += batch.num_rows


def _hf_chunks(path: str, keys: list[str], split: str | None, on_disk: int) -> Iterator[Chunk]:
    """A local Hugging Face dataset: a save_to_disk folder (memory-mapped Arrow), or any
    folder `datasets.load_dataset` understands, streamed. Offline: never a hub lookup. Progress by
    rows where the rows are counted (a saved dataset), else by the whole folder once it is read."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets  # slow to import: only when a Hugging Face input is given

    datasets.disable_progress_bars()
    if is_saved_dataset(path):
        dataset = datasets.load_from_disk(path)
    else:
        dataset = datasets.load_dataset(path, streaming=True)
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        dataset = _pick_split(dataset, split, path)
    counted = isinstance(dataset, datasets.Dataset)
    rows = _rows_per_chunk(dataset.data.nbytes / max(len(dataset), 1)) if counted else _STREAMING_ROWS
    first = 1
    for table in dataset.with_format("arrow").iter(batch_size=rows):
        done = on_disk * (first - 1 + table.num_rows) // max(len(dataset), 1) if counted else 0
        yield _columns_chunk(path, table, keys, first, table.column_names, done)
        first += table.num_rows


def _pick_split(dataset_dict, split: str | None, path: str):
    if split is None and len(dataset_dict) == 1:
        return next(iter(dataset_dict.values()))
    if split not in dataset_dict:
        raise InputError(f"--input {path} has splits {', '.join(dataset_dict)}: choose one with --hf-split")
    return dataset_dict[split]
