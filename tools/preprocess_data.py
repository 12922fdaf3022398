"""Tokenize a corpus into Megatron-LM indexed datasets: {output_prefix}_{key}_document.bin/.idx.

Flags match Megatron-LM's tools/preprocess_data.py where they overlap, and so do the bytes:
one sequence per document, the end-of-document id appended with --append-eod, the dtype
chosen from the vocabulary size. Unlike it, bad records are skipped and counted instead of
killing the run, outputs appear under their final names only when the run succeeds, and
Parquet, plain text and local Hugging Face datasets are read as well as (gzipped) JSONL.

Inputs (--input takes files, folders and globs, processed in the order given; a folder is
walked recursively in sorted order):
  *.jsonl, *.json, *.jsonl.gz, *.json.gz   one JSON object per line; --json-keys are its text fields
  *.parquet                                --json-keys are its string columns
  *.txt                                    the whole file is ONE document (not one per line or
                                           paragraph), written under the first --json-keys name
  a save_to_disk folder (or any folder with --input-format hf)   a local Hugging Face dataset

Skipped records, counted by reason in the summary and listed with --rejects FILE:
  malformed_json, not_object, missing_key, not_string (null included), empty_text (also text
  that gives no tokens; Megatron-LM writes those as empty documents), invalid_utf8, and
  unencodable (the tokenizer raised, e.g. on a lone surrogate). A record bad in one key is
  skipped in every key, so document i is the same record in each output. Blank lines are ignored.

Example:
    python tools/preprocess_data.py --input corpus/ --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt \\
        --append-eod --workers 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from megalite.data.indexed_dataset import IndexedDatasetWriter, data_file_path, index_file_path, optimal_dtype
from megalite.data.preprocess import Chunk, ChunkResult, Reject, WorkerConfig, encode_chunk, init_worker
from megalite.data.preprocess_inputs import FORMATS, InputError, Source, disk_bytes, expand_inputs, read_chunks
from megalite.data.tokenizers import TOKENIZER_TYPES
from megalite.training.metrics import format_duration


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that every output is aborted on the way out."""


class StrictError(Exception):
    """--strict and a bad record."""


def usable_cores() -> int:
    """Cores this process may run on (a Slurm or taskset allotment), not all of the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="files, folders or globs (quote globs)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="text fields / columns; one output dataset each")
    g.add_argument("--input-format", choices=FORMATS, default="auto",
                   help="auto: by suffix, and save_to_disk folders are Hugging Face datasets")
    g.add_argument("--hf-split", help="split of a Hugging Face dataset with several")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or Hugging Face tokenizer folder (Kimi's tiktoken "
                   "folder too) / tokenizer.json")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer: ids are < VOCAB_SIZE, eod = VOCAB_SIZE")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    g.add_argument("--rejects", metavar="FILE", help="write every skipped record as a JSON line: file, line, reason")
    g.add_argument("--strict", action="store_true",
                   help="fail at the first bad record (naming file and line), writing nothing")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=usable_cores(),
                   help="tokenizing processes (default: all usable cores)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress lines when stderr is not a terminal (a terminal gets a bar)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        p.error(f"--json-keys repeats a key: {' '.join(args.json_keys)}")
    return args


@dataclass
class Stats:
    start: float  # time.perf_counter() when the tool started
    documents: int = 0
    tokens: Counter = field(default_factory=Counter)
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    keys_seen: set[str] = field(default_factory=set)

    def add(self, result: ChunkResult) -> None:
        self.documents += len(next(iter(result.lengths.values())))
        self.tokens.update({key: int(lengths.sum()) for key, lengths in result.lengths.items()})
        self.bytes += result.size
        self.skipped.update(reject.reason for reject in result.rejects)
        self.keys_seen |= result.keys_seen

    def rates(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        tokens = sum(self.tokens.values())
        return (f"{self.documents:,} docs, {tokens:,} tokens, {self.bytes / 1e6:,.1f} MB in {seconds:.1f} s: "
                f"{self.documents / seconds:,.0f} docs/s, {self.bytes / 1e6 / seconds:.2f} MB/s, "
                f"{tokens / seconds:,.0f} tokens/s")


class Progress:
    """A tqdm bar on a terminal; in logs (not a terminal) a plain line every `log_interval` documents with the
    percentage of the input read, the time elapsed and an ETA. Progress is counted in on-disk bytes of the
    inputs, whatever their format (preprocess_inputs.read_chunks)."""

    def __init__(self, total_bytes: int, log_interval: int) -> None:
        self.total, self.read = total_bytes, 0
        self.bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, desc="tokenizing", smoothing=0.1,
                        disable=not sys.stderr.isatty())
        self.log_interval, self.next_log = log_interval, log_interval

    def update(self, stats: Stats, read_to: int) -> None:
        self.bar.update(read_to - self.read)
        self.read = read_to
        if not self.bar.disable:
            seconds = max(time.perf_counter() - stats.start, 1e-9)
            self.bar.set_postfix_str(f"{stats.documents:,} docs ({stats.documents / seconds:,.0f}/s), "
                                     f"{sum(stats.tokens.values()):,} tokens", refresh=False)
        elif stats.documents >= self.next_log:
            print(f"processed {self.line(stats)}", file=sys.stderr, flush=True)
            self.next_log = (stats.documents // self.log_interval + 1) * self.log_interval

    def line(self, stats: Stats) -> str:
        """`42.0% of 1,219.3 MB | <rates> | elapsed 1m02s | ETA 1m25s`; only the rates where the inputs' size
        is unknown (a named pipe)."""
        elapsed = time.perf_counter() - stats.start
        if not self.total:
            return f"{stats.rates()} | elapsed {format_duration(elapsed)}"
        done = min(self.read / self.total, 1.0)
        eta = format_duration(elapsed * (1 - done) / done) if done else "n/a"
        return (f"{done:.1%} of {self.total / 1e6:,.1f} MB | {stats.rates()} | elapsed {format_duration(elapsed)} "
                f"| ETA {eta}")

    def close(self) -> None:
        self.bar.close()


@contextmanager
def worker_pool(workers: int, config: WorkerConfig) -> Iterator[ProcessPoolExecutor]:
    """A process pool whose death is an error, never a hang: a killed worker makes every
    pending result raise BrokenProcessPool. On any error or interrupt the workers are
    terminated at once rather than left to finish chunks nobody will write."""
    executor = ProcessPoolExecutor(workers, initializer=init_worker, initargs=(config,))
    try:
        yield executor
    except BaseException:
        processes = list((executor._processes or {}).values())  # public as terminate_workers() only from Python 3.14
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        raise
    executor.shutdown()


def ordered_results(executor: ProcessPoolExecutor, chunks: Iterator[Chunk],
                    in_flight: int) -> Iterator[tuple[int, ChunkResult]]:
    """(on-disk bytes read through the chunk, its result) in input order (so the output is deterministic),
    at most `in_flight` chunks outstanding (so memory does not grow with the corpus)."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append((chunk.read_to, executor.submit(encode_chunk, chunk)))
        if len(pending) >= in_flight:
            read_to, result = pending.popleft()
            yield read_to, result.result()
    while pending:
        read_to, result = pending.popleft()
        yield read_to, result.result()


def describe(reject: Reject) -> str:
    where = reject.source if reject.line is None else f"{reject.source}:{reject.line}"
    return f"{where}: {reject.reason}: {reject.detail}"


def write_result(result: ChunkResult, writers: dict[str, IndexedDatasetWriter], rejects_file, strict: bool) -> None:
    if strict and result.rejects:
        raise StrictError(f"{describe(result.rejects[0])} (--strict)")
    for reject in result.rejects if rejects_file else ():
        rejects_file.write(json.dumps({"file": reject.source, "line": reject.line, "reason": reject.reason,
                                       "key": reject.key, "detail": reject.detail}) + "\n")
    for key, writer in writers.items():
        lengths = result.lengths[key]
        if len(lengths):
            writer.add_documents(np.split(result.tokens[key], np.cumsum(lengths)[:-1]))


def preprocess(args: argparse.Namespace, sources: list[Source], stats: Stats) -> Stats:
    """Tokenize every source into one writer per key; the outputs get their final names only if it all succeeds."""
    config = WorkerConfig(args.tokenizer_type, args.json_keys, args.append_eod, args.vocab_file,
                          args.merge_file, args.tokenizer_model, args.vocab_size)
    tokenizer = config.build_tokenizer()  # in the parent too: a bad flag fails here, clearly
    dtype = optimal_dtype(tokenizer.vocab_size)
    recorded = {"type": args.tokenizer_type, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    with ExitStack() as stack:
        writers = {key: stack.enter_context(
                       IndexedDatasetWriter(f"{args.output_prefix}_{key}_document", dtype, recorded))
                   for key in args.json_keys}
        rejects_file = stack.enter_context(open(args.rejects, "w", encoding="utf-8")) if args.rejects else None
        progress = Progress(sum(disk_bytes(source) for source in sources), args.log_interval)
        stack.callback(progress.close)
        executor = stack.enter_context(worker_pool(args.workers, config))
        chunks = read_chunks(sources, args.json_keys, args.hf_split)
        for read_to, result in ordered_results(executor, chunks, in_flight=2 * args.workers + 1):
            write_result(result, writers, rejects_file, args.strict)
            stats.add(result)
            progress.update(stats, read_to)
        if not stats.documents:
            raise InputError(no_documents(stats, args.json_keys))
        finalize_all(list(writers.values()))
    return stats


def no_documents(stats: Stats, keys: list[str]) -> str:
    """Why nothing would be written, as Megatron-LM would write an empty dataset: usually a wrong --json-keys or
    Parquet column, so the keys the records do have are listed."""
    given = " ".join(keys)
    if not sum(stats.skipped.values()):
        return "the inputs hold no records"
    skipped = ", ".join(f"{reason} {n:,}" for reason, n in sorted(stats.skipped.items()))
    if stats.keys_seen:
        return (f"no record has text under --json-keys {given} (skipped: {skipped}); the records' keys are "
                f"{', '.join(sorted(stats.keys_seen))}: pass the text field with --json-keys")
    return f"every record was skipped (skipped: {skipped}); --rejects FILE lists them with the reason"


def finalize_all(writers: list[IndexedDatasetWriter]) -> None:
    """All outputs under their final names, or none: a failure removes the ones already
    renamed. Ctrl-C and SIGTERM are ignored meanwhile (fsyncing a large .bin takes seconds):
    the work is done, and an interrupt between two renames would leave a partial set."""
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    finalized: list[str] = []
    try:
        for writer in writers:
            writer.finalize()
            finalized.append(writer.prefix)
    except BaseException:
        for prefix in finalized:
            for path in (data_file_path(prefix), index_file_path(prefix)):
                os.remove(path)
        raise
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def summary(stats: Stats, prefix: str, keys: list[str]) -> str:
    lines = [f"done: {stats.rates()}"]
    lines += [f"  {prefix}_{key}_document.bin/.idx: {stats.tokens[key]:,} tokens" for key in keys]
    skipped = sum(stats.skipped.values())
    lines.append(f"  skipped {skipped:,} records"
                 + (": " + ", ".join(f"{r} {n:,}" for r, n in sorted(stats.skipped.items())) if skipped else ""))
    return "\n".join(lines)


def _terminate(signum: int, frame) -> None:
    raise Terminated


def run(args: argparse.Namespace, start: float) -> int:
    """The whole run, with every expected failure turned into a message and an exit code."""
    try:
        sources, skipped = expand_inputs(args.input, args.input_format)
        if any(s.format == "text" for s in sources) and len(args.json_keys) > 1:
            raise InputError("plain-text inputs are one document each: give a single --json-keys name for their output")
        if skipped:
            print(f"note: skipped {len(skipped)} files with unknown suffixes, e.g. {skipped[0]}", file=sys.stderr)
        stats = preprocess(args, sources, Stats(start))
    except (InputError, FileNotFoundError, ValueError, StrictError) as error:
        print(f"preprocess_data.py: error: {error}; no output written", file=sys.stderr)
        return 1
    except BrokenProcessPool:
        print("preprocess_data.py: error: a worker process died (killed, or out of memory?); no output written",
              file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as interrupt:
        print(f"preprocess_data.py: interrupted ({type(interrupt).__name__}); no output written", file=sys.stderr)
        return 130 if isinstance(interrupt, KeyboardInterrupt) else 128 + signal.SIGTERM
    print(summary(stats, args.output_prefix, args.json_keys))
    return 0


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args, start)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
