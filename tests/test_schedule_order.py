"""The interleaved 1F1B order is Megatron-LM's, op for op.

The expected lists below were transcribed from Megatron-LM's own code
(megatron/core/pipeline_parallel/schedules.py at d98e8a64: `get_pp_rank_microbatches`,
`get_schedule_table`, `forward_backward_pipelining_with_interleaving`), with
microbatch_group_size_per_vp_stage = pp and no p2p overlap: warm-up forwards, then forward k+warm-up
followed by backward k, then the remaining backwards; backward k runs chunk vp-1-c of the table's
entry k. Written out as data so that the test does not share a formula with the implementation.
Each op is "F" or "B", then chunk.microbatch.
"""

from __future__ import annotations

import pytest

from megalite.parallel.pipeline.registry import schedule_ops

MEGATRON_ORDER = {
    (2, 2, 4): [
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3",
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3",
    ],
    (4, 2, 8): [
        "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 F0.4 F0.5 F0.6 B1.0 F0.7 B1.1 F1.4 B1.2 "
        "F1.5 B1.3 F1.6 B0.0 F1.7 B0.1 B0.2 B0.3 B1.4 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7",
        "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 F0.4 B1.0 F0.5 B1.1 F0.6 B1.2 F0.7 B1.3 "
        "F1.4 B0.0 F1.5 B0.1 F1.6 B0.2 F1.7 B0.3 B1.4 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7",
        "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F0.4 B1.2 F0.5 B1.3 F0.6 B0.0 "
        "F0.7 B0.1 F1.4 B0.2 F1.5 B0.3 F1.6 B1.4 F1.7 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7",
        "F0.0 F0.1 F0.2 F0.3 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 F0.4 B0.0 F0.5 B0.1 "
        "F0.6 B0.2 F0.7 B0.3 F1.4 B1.4 F1.5 B1.5 F1.6 B1.6 F1.7 B1.7 B0.4 B0.5 B0.6 B0.7",
    ],
    (2, 3, 4): [
        "F0.0 F0.1 F1.0 F1.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F1.2 B1.0 F1.3 B1.1 F2.2 B0.0 "
        "F2.3 B0.1 B2.2 B2.3 B1.2 B1.3 B0.2 B0.3",
        "F0.0 F0.1 F1.0 F1.1 F2.0 B2.0 F2.1 B2.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 "
        "F2.2 B2.2 F2.3 B2.3 B1.2 B1.3 B0.2 B0.3",
    ],
}

# With as many micro batches as stages, Megatron-LM before commit 4295be1a6c (Nov 2024) ran every
# forward first on every rank; megalite keeps that rule. Later Megatron-LM uses the usual warm-up
# count here too, so its ranks 2 and 3 start 1F1B earlier: this case pins megalite's choice.
ALL_FORWARDS_FIRST = "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 B1.0 B1.1 B1.2 B1.3 B0.0 B0.1 B0.2 B0.3"


def _text(ops) -> str:
    """Ops in the notation of the expected lists, so a mismatch shows where the orders part."""
    return " ".join(f"{kind}{chunk}.{mb}" for kind, chunk, mb in ops)


@pytest.mark.parametrize("pp, vp, m", list(MEGATRON_ORDER))
def test_interleaved_order_is_megatrons(pp, vp, m):
    for rank, expected in enumerate(MEGATRON_ORDER[(pp, vp, m)]):
        assert _text(schedule_ops("1f1b", pp, vp, rank, m)) == expected, f"rank {rank}"


def test_as_many_microbatches_as_stages_runs_all_forwards_first():
    for rank in range(4):
        assert _text(schedule_ops("1f1b", 4, 2, rank, 4)) == ALL_FORWARDS_FIRST, f"rank {rank}"
