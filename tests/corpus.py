"""A small preprocessed corpus for tests that train on real documents (EOD tokens, document boundaries)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megalite.data.indexed_dataset import IndexedDatasetWriter

VOCAB = 300  # token ids below it; the NullTokenizer's eod is VOCAB itself


def write_corpus(prefix: Path, documents: int, seed: int, vocab: int = VOCAB) -> str:
    """Documents of random length (5 to 59 tokens) ending in the NullTokenizer's eod (= `vocab`)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.integers(0, vocab, rng.integers(5, 60)), vocab))
    return str(prefix)
