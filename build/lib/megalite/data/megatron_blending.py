"""Megatron-Core's blend, reproduced exactly (data.blend_rule=megatron), so that a run continued from a
Megatron-LM checkpoint trains on the batches Megatron-LM would have trained on next.

Megatron-Core (megatron/core/datasets: blended_megatron_dataset_builder.py, blended_dataset.py and
helpers.cpp's build_blending_indices) blends datasets with normalised weights w as follows:

- sizes: for a blend of `size` samples, dataset d is built with ceil(ceil(size * w_d) * (1 + surplus))
  samples (mid_level_dataset_surplus, 0.005 unless --mid-level-dataset-surplus says otherwise), and the
  blend has sum_d ceil(size * w_d) samples, marginally more than `size`;
- order: BlendedDataset normalises the weights once more, then sample i comes from the dataset with the
  largest error w_d * max(i, 1) - count_d (float64, the lowest index on ties), where count_d is how many
  samples dataset d gave before; that is sample count_d of dataset d.

The greedy loop is sequential: each pick changes the counts the next one compares. Here it runs as many
chunks side by side (one numpy step advances every chunk by one sample), each chunk started from a guess
of the counts at its first sample; then every chunk whose guess differs from where the chunk before it
really ended is run again from there, until its counts meet those of its first run (from then on the two
runs are the same). When no start differs from the end before it, every chunk is the greedy loop run from
the previous chunk's end: the whole stream equals the sequential loop's, bit for bit, however good the
guesses were (good guesses only make it fast: runs meet within a few samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SURPLUS = 0.005  # Megatron-Core's default mid_level_dataset_surplus
MAX_DATASETS = np.iinfo(np.int16).max - 1  # Megatron-Core's dataset index is int16 (it asserts fewer than 32767)
CHUNK = 4096  # samples each chunk advances through: the Python loop's length
LANES = 1 << 22  # chunks times datasets advanced per numpy step, to bound temporary memory


def normalise(weights: Sequence[float]) -> np.ndarray:
    """Weights divided by their sum in float64, exactly as Megatron-Core's utils.normalize."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blend weights must be a non-empty list of positive numbers, got {list(weights)}")
    return w / np.sum(w)


def requested_sizes(weights: Sequence[float], size: int, surplus: float = SURPLUS) -> list[int]:
    """Megatron-Core's samples to build per dataset for a blend of `size`: ceil(ceil(size * w) * (1 + surplus)),
    with the weights as given (the builder's, normalised once)."""
    return [math.ceil(math.ceil(size * float(x)) * (1 + surplus)) for x in weights]


def megatron_blend_sizes(weights: Sequence[float], size: int) -> tuple[list[int], int]:
    """(samples to build per dataset, length of the blend) for a blend of `size`, as Megatron-Core's builder
    sizes them; `weights` normalised once, as parse_blend gives them."""
    if not np.isclose(sum(weights), 1.0):
        raise ValueError(f"blend weights {list(weights)} must be normalised (sum to 1), as parse_blend gives them")
    return requested_sizes(weights, size), sum(math.ceil(size * float(x)) for x in weights)


def megatron_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index per sample, sample index within that dataset) of a blend of `size`, equal to
    Megatron-Core's BlendedDataset given the same (builder's) weights."""
    if size < 0:
        raise ValueError(f"blend size must be >= 0, got {size}")
    w = normalise(normalise(weights))  # the builder normalises, then BlendedDataset once more
    if len(w) > MAX_DATASETS:
        raise ValueError(f"Megatron-Core blends at most {MAX_DATASETS} datasets (an int16 dataset index), "
                         f"got {len(w)}; use data.blend_rule=megalite")
    length = max(1, min(CHUNK, size))
    num_chunks = -(-size // length)
    dataset_index = np.empty(num_chunks * length, dtype=np.int16)  # the last chunk may run past `size`
    dataset_sample_index = np.empty(num_chunks * length, dtype=np.int64)
    per_window = max(1, LANES // len(w))
    counts = np.zeros(len(w), dtype=np.int64)
    for first in range(0, num_chunks, per_window):
        rows = slice(first * length, min(first + per_window, num_chunks) * length)
        counts = _greedy_chunks(w, first * length, counts, dataset_index[rows].reshape(-1, length),
                                dataset_sample_index[rows].reshape(-1, length))
    return dataset_index[:size], dataset_sample_index[:size]


def _greedy_chunks(w: np.ndarray, first: int, counts: np.ndarray, picks: np.ndarray, taken: np.ndarray
                   ) -> np.ndarray:
    """Fill picks[k, j] and taken[k, j] (dataset and its sample index) for sample first + k * length + j,
    given the counts before `first`; returns the counts after the last chunk."""
    num_chunks, length = picks.shape
    times = first + np.arange(num_chunks, dtype=np.int64) * length
    starts = _guess_counts(w, times)
    starts[0] = counts
    ends = _run(w, times, np.arange(num_chunks), starts.copy(), picks, taken)
    while True:
        wrong = np.flatnonzero(np.any(ends[:-1] != starts[1:], axis=1)) + 1
        if len(wrong) == 0:
            return ends[-1]
        earlier = starts[wrong]
        starts[wrong] = ends[wrong - 1]
        ends[wrong] = _rerun(w, times, wrong, starts[wrong], earlier, ends[wrong], picks, taken)


def _guess_counts(w: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Counts near the greedy loop's at each time: floor(time * w), plus one for the datasets with the
    largest remainders until they sum to the time."""
    exact = times[:, None] * w
    counts = np.floor(exact).astype(np.int64)
    short = times - counts.sum(axis=1)
    by_remainder = np.argsort(counts - exact, axis=1, kind="stable")
    counts[np.arange(len(times))[:, None], by_remainder] += np.arange(len(w)) < short[:, None]
    return counts


def _step(w: np.ndarray, times: np.ndarray, chunks: np.ndarray, counts: np.ndarray, picks: np.ndarray,
          taken: np.ndarray, step: int) -> None:
    """One sample of every chunk in `chunks`, whose counts so far are `counts` (updated in place):
    helpers.cpp's error weight * max(i, 1.0) - count in float64, the first maximum winning ties."""
    sample = np.maximum(times[chunks] + step, 1).astype(np.float64)
    pick = np.argmax(w * sample[:, None] - counts, axis=1)
    rows = np.arange(len(chunks))
    picks[chunks, step] = pick
    taken[chunks, step] = counts[rows, pick]
    counts[rows, pick] += 1


def _run(w: np.ndarray, times: np.ndarray, chunks: np.ndarray, counts: np.ndarray, picks: np.ndarray,
         taken: np.ndarray) -> np.ndarray:
    """Run the greedy loop through `chunks` from their `counts`; returns the counts at their ends."""
    for step in range(picks.shape[1]):
        _step(w, times, chunks, counts, picks, taken, step)
    return counts


def _rerun(w: np.ndarray, times: np.ndarray, chunks: np.ndarray, counts: np.ndarray, earlier: np.ndarray,
           ends: np.ndarray, picks: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Run `chunks` again from new `counts`, over their earlier runs (which started from `earlier` and ended
    at `ends`), each only until its counts equal its earlier run's; returns the counts at their ends."""
    ends, counts, earlier = ends.copy(), counts.copy(), earlier.copy()
    unmet = np.arange(len(chunks))  # which entry of `ends` each chunk still running fills
    for step in range(picks.shape[1]):
        earlier[np.arange(len(chunks)), picks[chunks, step]] += 1
        _step(w, times, chunks, counts, picks, taken, step)
        apart = np.any(counts != earlier, axis=1)
        chunks, counts, earlier, unmet = chunks[apart], counts[apart], earlier[apart], unmet[apart]
        if len(chunks) == 0:
            break
    ends[unmet] = counts
    return ends
