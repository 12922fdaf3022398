"""Synthetic pretraining data for runs without a corpus.

Each sample is a deterministic function of (seed, global sample index), so every
parallel layout and every resume sees the same tokens. Samples repeat a random motif,
which a transformer learns to copy (induction), so the loss visibly falls well below
log(vocab) and a broken model or optimizer shows up as a flat curve. Motif tokens follow
a Zipf law, as words do, so even a tiny model has unigram statistics to learn at once.
"""

from __future__ import annotations

import numpy as np
import torch

from megalite.model.init import parameter_seed

VALIDATION_OFFSET = 2**40


class MockDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, offset: int = 0) -> None:
        self.vocab_size, self.seq_length, self.seed, self.offset = vocab_size, seq_length, seed, offset
        self.zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)

    def __getitem__(self, index: int) -> np.ndarray:
        """seq_length + 1 token ids (inputs and shifted labels) as int64."""
        generator = torch.Generator().manual_seed(parameter_seed(self.seed, f"mock/{index + self.offset}"))
        motif_length = int(torch.randint(4, 17, (1,), generator=generator))
        motif = torch.multinomial(self.zipf, motif_length, replacement=True, generator=generator)
        return motif.repeat(self.seq_length // motif_length + 2)[: self.seq_length + 1].numpy()
