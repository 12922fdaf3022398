"""Sampling and batching: the global order does not depend on dp or the micro batch size,
resume continues exactly (also after a dp change), EOD masking and position reset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megalite.data.batches import BatchMaker, document_positions
from megalite.data.loader import MicroBatchSampler, micro_batches


class Numbers:
    """Sample i is [i, i+1, ..., i+seq]: which samples a batch holds is visible in its tokens."""

    def __getitem__(self, i: int) -> np.ndarray:
        return np.arange(i, i + 5, dtype=np.int64)


def _global_batches(dp: int, mb: int, gbs: int, steps: int, first: int = 0, workers: int = 0) -> list[set[int]]:
    """The set of sample ids each global batch contains, gathered over all dp ranks."""
    per_rank = [list(micro_batches(Numbers(), BatchMaker(), first, first + steps * gbs, mb, dp, r, workers,
                                   torch.device("cpu")))
                for r in range(dp)]
    per_step = gbs // (mb * dp)
    return [{int(t) for r in range(dp) for b in per_rank[r][s * per_step:(s + 1) * per_step] for t in b.tokens[:, 0]}
            for s in range(steps)]


@pytest.mark.parametrize("dp, mb", [(2, 1), (4, 2), (8, 1), (1, 8)])
def test_global_batches_do_not_depend_on_dp_or_micro_batch(dp, mb):
    assert (_global_batches(dp, mb, 8, 3) == _global_batches(1, 1, 8, 3)
            == [set(range(s * 8, s * 8 + 8)) for s in range(3)])


def test_resume_from_consumed_samples_after_dp_change():
    uninterrupted = _global_batches(2, 2, 8, 5)
    assert _global_batches(4, 1, 8, 3, first=16) == uninterrupted[2:]


def test_background_workers_give_the_same_batches():
    assert _global_batches(2, 2, 8, 3, workers=2) == _global_batches(2, 2, 8, 3)


def test_sampler_length_and_ranks_are_disjoint():
    ranks = [list(MicroBatchSampler(10, 26, 2, 4, r)) for r in range(4)]
    assert [len(r) for r in ranks] == [2, 2, 2, 2] and len(MicroBatchSampler(10, 26, 2, 4, 0)) == 2
    assert sorted(i for r in ranks for b in r for i in b) == list(range(10, 26))


def test_shifted_labels():
    batch = BatchMaker()([np.arange(6), np.arange(10, 16)])
    assert batch.tokens.tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    assert batch.labels.tolist() == [[1, 2, 3, 4, 5], [11, 12, 13, 14, 15]]
    assert batch.position_ids is None and batch.loss_mask.sum() == 10


def test_eod_masks_loss_and_resets_positions():
    eod = 0
    batch = BatchMaker(eod, reset_position_ids=True, eod_mask_loss=True)([np.array([5, 6, 0, 7, 8, 0, 0, 9, 3])])
    assert batch.tokens.tolist() == [[5, 6, 0, 7, 8, 0, 0, 9]]
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1, 1, 0, 0, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0]]


def test_document_positions_match_megatron_rule():
    """Megatron: after each eod at i, positions from i+1 on restart at 0."""
    tokens = torch.randint(0, 4, (3, 50))
    expected = torch.arange(50).repeat(3, 1)
    for b in range(3):
        for i in (tokens[b, :-1] == 0).nonzero().flatten().tolist():
            expected[b, i + 1:] -= expected[b, i + 1].item()
    assert torch.equal(document_positions(tokens, 0), expected)
