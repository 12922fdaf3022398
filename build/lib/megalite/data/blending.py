"""Blend several datasets into one stream with fixed weights, as Megatron-LM's --data-path does.

Two rules (data.blend_rule, BLEND_RULES below) size and order a blend. "megatron" is Megatron-Core's
own, exactly (megatron_blending.py: a greedy C++ loop, "the dataset furthest behind its share goes next",
and a 0.5% surplus per dataset), for runs that continue Megatron-LM's. "megalite", the default, is this
module's: dataset d's k-th sample is due at time (k + 0.5) / w_d, and the blend
is all datasets' due times merged in order (ties go to the lower dataset index): the
sequential Sainte-Lague (Webster) apportionment, computed with a stable argsort. For the
first n samples, each dataset's due times up to the n-th pick's time T are in, so its count
c_d lies within 1/2 of T * w_d; summing over the D datasets, n lies within D/2 of T, hence

    |c_d(n) - n * w_d| <= (1 + (D - 2) * w_d) / 2      for every prefix n,

which keeps every share within 1% of its weight from n = 50 * (D - 1) samples on
(tests/test_blending.py checks the bound at every prefix), and sizes each dataset so that the
blend never runs it dry."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megalite.data.megatron_blending import (
    SURPLUS,
    megatron_blend_sizes,
    megatron_blending_indices,
    normalise,
    requested_sizes,
)

MERGE_CHUNK = 1 << 22  # samples merged per argsort, to bound temporary memory


def max_deviation(weights: Sequence[float]) -> np.ndarray:
    """Per dataset, the most its count can differ from n * weight at any prefix n (module docstring)."""
    w = normalise(weights)
    return (1 + (len(w) - 2) * w) / 2


def blend_sizes(weights: Sequence[float], size: int, surplus: float = SURPLUS) -> list[int]:
    """How many samples to build per dataset so that a blend of `size` never runs one dry.

    Megatron-LM's request, ceil(ceil(size * w) * (1 + surplus)), raised where needed to the
    proven maximum use size * w + max_deviation (which only matters for tiny sizes).
    """
    w = normalise(weights)
    requested = requested_sizes(w, size, surplus)
    needed = [math.floor(size * x + dev + 1e-6) for x, dev in zip(w, max_deviation(w))]  # counts are integers
    return [max(r, n) for r, n in zip(requested, needed)]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index per sample, sample index within that dataset), deterministic for the weights."""
    if size < 0:
        raise ValueError(f"blend size must be >= 0, got {size}")
    w = normalise(weights)
    dataset_index = np.empty(size, dtype=np.int16 if len(w) <= np.iinfo(np.int16).max else np.int32)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    used = np.zeros(len(w), dtype=np.int64)
    for begin in range(0, size, MERGE_CHUNK):
        end = min(begin + MERGE_CHUNK, size)
        dataset_index[begin:end], dataset_sample_index[begin:end] = _merge_next(w, used, end - begin)
        used += np.bincount(dataset_index[begin:end], minlength=len(w))
    return dataset_index, dataset_sample_index


def _merge_next(w: np.ndarray, used: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The next n picks of the merged stream, given how many samples each dataset has given so far.

    By the bound, any n consecutive picks take at most n * w_d + D - 1 samples from dataset d,
    so merging that many upcoming due times per dataset yields exactly the global stream.
    """
    candidates = np.ceil(n * w).astype(np.int64) + len(w)
    owner = np.repeat(np.arange(len(w)), candidates)
    first = np.cumsum(candidates) - candidates
    k = np.arange(candidates.sum(), dtype=np.int64) - first[owner] + used[owner]
    order = np.argsort((k + 0.5) / w[owner], kind="stable")[:n]
    return owner[order], k[order]


@dataclass(frozen=True)
class BlendRule:
    """How a blend asked for `size` samples is sized and ordered (data.blend_rule)."""

    sizes: Callable[[Sequence[float], int], tuple[list[int], int]]  # -> (samples to build per dataset, blend length)
    indices: Callable[[Sequence[float], int], tuple[np.ndarray, np.ndarray]]  # (weights, blend length) -> order
    remedy: Callable[[int, int], str]  # (blend length, dataset) -> how to fix a dataset the blend runs dry


BLEND_RULES = {
    "megalite": BlendRule(lambda weights, size: (blend_sizes(weights, size), size), blending_indices,
                          lambda size, d: f"build it with blend_sizes(weights, {size})[{d}] samples"),
    "megatron": BlendRule(megatron_blend_sizes, megatron_blending_indices,
                          lambda size, d: f"Megatron-Core's surplus of {SURPLUS} is too small here (Megatron-LM "
                                          "fails the same way): train for more samples, or use data.blend_rule="
                                          "megalite, whose sizes never run short"),
}


class BlendedDataset:
    """Sample i is datasets[dataset_index[i]][dataset_sample_index[i]], in the order of `rule`
    (BLEND_RULES); `size` is the blend's length."""

    def __init__(self, datasets: list, weights: list[float], size: int, rule: str = "megalite") -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = BLEND_RULES[rule].indices(weights, size)
        drawn = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (dataset, count) in enumerate(zip(datasets, drawn)):
            if len(dataset) < count:
                raise ValueError(f"blended dataset {d} has {len(dataset)} samples but the blend of {size} draws "
                                 f"{count} from it; {BLEND_RULES[rule].remedy(size, d)}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a blend of {len(self)}")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def parse_blend(paths: list) -> tuple[list[float], list[str]]:
    """Megatron-style ["0.7", "prefixA", "0.3", "prefixB"], or ["prefix"], -> (weights, prefixes), the weights
    normalised as Megatron-Core's builder normalises them."""
    items = [str(p) for p in paths]
    example = "expected a single dataset prefix or 'weight prefix' pairs such as ['0.7', 'dataA', '0.3', 'dataB']"
    if len(items) == 1 and not _is_number(items[0]):
        return [1.0], items
    if not items or len(items) % 2:
        raise ValueError(f"blend {items}: {example}")
    weights = []
    for position in range(0, len(items), 2):
        weight, prefix = items[position], items[position + 1]
        if not _is_number(weight) or not 0 < float(weight) < math.inf:
            raise ValueError(f"blend {items}: entry {position} ({weight!r}) should be a positive weight "
                             f"for {prefix!r}; {example}")
        if _is_number(prefix):
            raise ValueError(f"blend {items}: entry {position + 1} ({prefix!r}) is a number where a dataset "
                             f"prefix belongs; {example}")
        weights.append(float(weight))
    return normalise(weights).tolist(), items[1::2]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
