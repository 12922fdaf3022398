"""Time and memory of building GPTDataset indices for a large corpus, and of reloading them.

A synthetic corpus (10 million documents of 1-1999 tokens, ~10 billion tokens, by default)
is indexed at seq 2048 for one epoch (num_samples = (tokens - 1) // seq) on one core: the
process pins itself to one CPU and numpy's threads are limited to 1 before numpy loads.
Only `sequence_lengths` is needed to build indices, so the corpus holds no tokens.

Prints the build time, the peak RSS of the process (the 40 MB of synthetic lengths and
the interpreter included), and the best of several reloads from the cache. Reloads find the
files in the page cache, as ranks on the builder's node do.

    python tools/benchmark_data_index.py
    python tools/benchmark_data_index.py --documents 1000000 --cache-dir /tmp/index_cache
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from megalite.data.gpt_dataset import GPTDataset  # noqa: E402


class LengthsOnly:
    """A TokenDocuments with document lengths but no tokens: enough to build indices."""

    def __init__(self, num_documents: int, mean_length: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.sequence_lengths = rng.integers(1, 2 * mean_length, num_documents, dtype=np.int32)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        raise NotImplementedError("the benchmark reads no tokens")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=10_000_000)
    parser.add_argument("--mean-length", type=int, default=1000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--cache-dir", default=None, help="default: a temporary directory, removed afterwards")
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    corpus = LengthsOnly(args.documents, args.mean_length, seed=0)
    tokens = int(corpus.sequence_lengths.sum(dtype=np.int64))
    num_samples = (tokens - 1) // args.seq
    ids = np.arange(args.documents, dtype=np.int32)
    print(f"corpus: {args.documents:,} documents, {tokens:,} tokens; seq {args.seq}, {num_samples:,} samples")
    print(f"peak RSS before building: {peak_rss_mb():.0f} MB")

    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = args.cache_dir or scratch
        make = lambda: GPTDataset(corpus, ids, num_samples, args.seq, 1234, cache_dir,  # noqa: E731
                                  f"synthetic-{args.documents} train")
        start = time.perf_counter()
        dataset = make()
        build_s = time.perf_counter() - start
        print(f"build (and write cache): {build_s:.2f} s, peak RSS {peak_rss_mb():.0f} MB, {len(dataset):,} samples")
        del dataset
        reloads = []
        for _ in range(args.reloads):
            start = time.perf_counter()
            make()
            reloads.append(time.perf_counter() - start)
        print(f"reload from cache: best {min(reloads):.3f} s of {args.reloads} (worst {max(reloads):.3f} s)")
        print(f"cache size: {sum(e.stat().st_size for e in os.scandir(cache_dir)) / 2**20:.0f} MiB in {cache_dir}")


if __name__ == "__main__":
    main()
