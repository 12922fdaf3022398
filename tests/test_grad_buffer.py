"""GradBuffer's layout and reduction, pinned down where they are easy to break: bucket boundaries,
alignment (parameters start at multiples of 64 elements, buckets end at multiples of lcm(dp, 128), as
Megatron-LM aligns them), which rank owns which elements, which buckets reduce during backward and which
only in `finish`, and the sums themselves on 2 gloo ranks.

Parameters have 1, 3, 5, 2 and 4 elements (creation order) and buckets hold 6 elements (padding counts),
so one bucket closes at the size, one overshoots it (a parameter is never split), one is left over.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

from megalite.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel import gemm, lookup
from megalite.parallel.bucket_layout import BucketLayout
from megalite.parallel.grad_buffer import GradBuffer, readers
from megalite.parallel.weight_grads import WeightGradients, deferred

SIZES = [1, 3, 5, 2, 4]
BUCKET = 6


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _buffer(params: list[nn.Parameter], dp: int = 1, dp_rank: int = 0, distributed: bool = False,
            overlap: bool = True, held: frozenset[int] = frozenset()) -> GradBuffer:
    group = dist.group.WORLD if dist.is_initialized() else None
    return GradBuffer(params, BUCKET, group, dp, dp_rank, 1 if distributed else 0, overlap, held)


def _layout(buffer: GradBuffer, params: list[nn.Parameter]) -> list[tuple[int, int, list[int]]]:
    """Each bucket as (start, end, its parameters by creation index)."""
    index = {id(p): i for i, p in enumerate(params)}
    return [(b.start, b.end, [index[id(p)] for p in b.params]) for b in buffer.buckets]


def test_buckets_fill_in_reverse_creation_order_and_close_at_bucket_size():
    """Backward produces gradients roughly last parameter first, so buckets fill in that order."""
    params = _params()
    buffer = _buffer(params)
    assert _layout(buffer, params) == [(0, 128, [4, 3]), (128, 256, [2, 1]), (256, 384, [0])]
    buffer.strategy.grad_data.copy_(torch.arange(384.0))
    starts = [256, 192, 128, 64, 0]  # main_grad is a view of the buffer at the parameter's offset
    for param, start in zip(params, starts):
        assert torch.equal(param.main_grad, torch.arange(start, start + param.numel(), dtype=torch.float32))


def test_distributed_buckets_pad_to_multiple_of_dp_and_keep_parameter_values():
    """Reduce-scatter needs equal shards: every bucket is padded to a multiple of lcm(dp, 128), and the
    parameters move into a flat buffer of the same layout without changing value."""
    params = _params()
    values = [p.detach().clone() for p in params]
    buffer = _buffer(params, dp=6, distributed=True)
    assert _layout(buffer, params) == [(0, 384, [4, 3]), (384, 768, [2, 1]), (768, 1152, [0])]
    strategy = buffer.strategy
    assert strategy.grad_data.numel() == strategy.param_data.numel() == 1152
    for param, value in zip(params, values):
        assert torch.equal(param.detach(), value)
    assert torch.equal(strategy.param_data[[4, 63, 66, 383, 389, 447, 451, 769, 1151]], torch.zeros(9))
    strategy.param_data[65] = 99.0  # the last element of parameter 3: parameters are views of the buffer
    assert params[3][-1].item() == 99.0


def _gpt2_1_3b() -> list[nn.Parameter]:
    """GPT-2 1.3B's parameters (24 layers, width 2048) on the meta device: shapes only."""
    cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257)
    return list(GPTModel(cfg, torch.device("meta"), seed=0).parameters())


@pytest.mark.parametrize("dp", range(1, 25))
def test_every_view_and_shard_is_aligned(dp):
    """GPT-2 1.3B at dp 1-24 with the distributed optimizer: every parameter's view starts at a multiple of 64
    elements and every rank's shard of every bucket at a multiple of 128 / gcd(dp, 128) (at least 16 bytes
    in bf16). Before this layout, dp 6 left 144 of 292 views unaligned and every bucket start misaligned."""
    params = _gpt2_1_3b()
    layout = BucketLayout(list(reversed(params)), 40_000_000, dp)
    assert all(start % 64 == 0 for start, _ in layout.offsets.values())
    quantum = 128 // math.gcd(dp, 128)
    for bucket in layout.buckets:
        assert bucket.start % math.lcm(dp, 128) == 0 and bucket.end % math.lcm(dp, 128) == 0
        assert all(bucket.shard(rank, dp)[0] % quantum == 0 for rank in range(dp))
    assert layout.size - sum(p.numel() for p in params) < 64 * len(params) + math.lcm(dp, 128) * len(layout.buckets)


def _owned_elements(dp: int) -> dict[int, list[tuple[int, int, int]]]:
    """param index -> (lo, hi, rank) for each range that some rank's optimizer shard owns."""
    owned: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(SIZES))}
    for rank in range(dp):
        params = _params()
        index = {id(p): i for i, p in enumerate(params)}
        for param, lo, hi in _buffer(params, dp=dp, dp_rank=rank, distributed=True).owned_ranges():
            owned[index[id(param)]].append((lo, hi, rank))
    return owned


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_owned_ranges_are_disjoint_and_cover_every_parameter(dp):
    """Every element is stepped by exactly one rank; padding is owned by none."""
    for i, ranges in _owned_elements(dp).items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == SIZES[i], f"param {i}: {ranges}"
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"param {i}: {ranges}"


def test_without_distributed_optimizer_each_rank_owns_whole_parameters():
    params = _params()
    index = {id(p): i for i, p in enumerate(params)}
    owned = [(index[id(p)], lo, hi) for p, lo, hi in _buffer(params, dp=2, dp_rank=1).owned_ranges()]
    assert owned == [(i, 0, SIZES[i]) for i in reversed(range(len(SIZES)))]


def _backward(params: list[nn.Parameter], inputs: list[torch.Tensor], scale: float) -> None:
    sum(scale * (p * x).sum() for p, x in zip(params, inputs)).backward()


def _step(rank: int, distributed: bool, overlap: bool) -> dict:
    """Two micro batches (the second after start_sync) on a buffer whose parameter 0 is held; rank r's
    micro batch k scales the gradient by (r + 1) * (k + 1)."""
    params = _params()
    inputs = _params(seed=1)
    buffer = _buffer(params, dp=2, dp_rank=rank, distributed=distributed, overlap=overlap,
                     held=frozenset({id(params[0])}))
    buffer.zero()
    _backward(params, inputs, (rank + 1) * 1.0)
    accumulating = [b.index in buffer.strategy.in_flight for b in buffer.buckets]
    buffer.start_sync()
    _backward(params, inputs, (rank + 1) * 2.0)
    syncing = [b.index in buffer.strategy.in_flight for b in buffer.buckets]
    buffer.finish()
    index = {id(p): i for i, p in enumerate(params)}
    owned = [(index[id(p)], lo, hi) for p, lo, hi in buffer.owned_ranges()]
    return {"accumulating": accumulating, "syncing": syncing, "owned": owned,
            "grads": [p.main_grad.clone() for p in params], "inputs": [x.detach() for x in inputs]}


def _two_ranks(rank: int, world_size: int) -> dict:
    return {(d, o): _step(rank, d, o) for d in (False, True) for o in (False, True)}


@pytest.fixture(scope="module")
def two_rank_steps() -> list[dict]:
    """One spawn of 2 gloo ranks runs every (distributed, overlap) case."""
    return run_ranks(2, _two_ranks)


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_only_the_last_micro_batch_launches_and_held_buckets_wait_for_finish(two_rank_steps, distributed, overlap):
    """Earlier micro batches only accumulate; with overlap, a bucket launches during the last backward
    unless it holds a held (tied) parameter, which must first be combined with another stage's."""
    for result in two_rank_steps:
        step = result[(distributed, overlap)]
        assert step["accumulating"] == [False, False, False]
        assert step["syncing"] == [overlap, overlap, False]


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_reduction_sums_both_micro_batches_over_ranks(two_rank_steps, distributed, overlap):
    """All-reduce: every element is the sum over ranks and micro batches, (1 + 2) * (1 + 2) = 9 times
    the input. Reduce-scatter: the elements a rank owns are (the rest is not read by its optimizer)."""
    for result in two_rank_steps:
        step = result[(distributed, overlap)]
        for i, lo, hi in step["owned"]:
            expected = 9 * step["inputs"][i][lo:hi]
            assert torch.allclose(step["grads"][i][lo:hi], expected, rtol=1e-6, atol=0), f"param {i}"
        if not distributed:
            assert sorted(i for i, _, _ in step["owned"]) == list(range(len(SIZES)))


@pytest.mark.parametrize("deferred_w", [False, True])
def test_a_weight_read_by_three_modules_is_complete_after_its_last_readers_gradient(deferred_w):
    """Any number of readers of one weight in one backward (a tied embedding's lookup and LM head, a
    multi-token-prediction head next to them) follow one rule: each gradient but the last waits beside the
    buffer, the last adds them into the main gradient, and only then does the bucket count the weight, once per
    backward, whether the gradients come at once or in a zero-bubble W. The sum is autograd's."""
    g = torch.Generator().manual_seed(0)
    table, ids, x = torch.randn(10, 8, generator=g), torch.tensor([[1, 4], [4, 9]]), torch.randn(3, 8, generator=g)

    def forward(weight: torch.Tensor) -> torch.Tensor:
        looked_up = lookup.embedding(ids, weight)
        return looked_up.sum() + gemm.linear(x, weight).square().sum() + gemm.linear(2 * x, weight).sum()

    reference = table.clone().requires_grad_()
    forward(reference).backward()
    weight = nn.Parameter(table.clone())
    buffer = GradBuffer([weight], BUCKET, None, 1, 0, 0, False, reads=readers([[(None, [weight])] * 3]))
    complete = []
    buffer.on_grads_in = complete.append
    for micro_batch in range(2):
        queue = WeightGradients()
        with deferred(queue) if deferred_w else contextlib.nullcontext():
            forward(weight).backward()
        assert len(complete) == micro_batch + (not deferred_w)  # deferred: nothing before W
        queue.run()
        assert len(complete) == micro_batch + 1 and weight.grad is None
    torch.testing.assert_close(weight.main_grad, 2 * reference.grad, rtol=1e-6, atol=1e-6)
