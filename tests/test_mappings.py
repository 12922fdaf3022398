"""Each autograd communication function on 2 gloo ranks equals its one-process computation, forward
and backward: a wrong conjugate (say, a split where a reduce-scatter belongs) would otherwise only
show up as a small parity error in a whole model.

Rank r's inputs and upstream gradients are fixed random tensors of shape [sequence, batch, hidden];
the expected values are built from all ranks' tensors in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from megalite.parallel.mappings import (
    all_gather_single,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_single,
    reduce_scatter_to_sp,
    scatter_to_sp,
)

WORLD = 2
FULL, HALF = (4, 2, 6), (2, 2, 6)


def _t(seed: int, shape: tuple[int, ...] = FULL) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _shard(x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    return x.chunk(WORLD, dim)[rank]


def _upstream(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The gradient rank `rank` feeds backward: different on each rank, so a missing reduction shows."""
    return _t(20 + rank, shape)


def _both(shape: tuple[int, ...]) -> torch.Tensor:
    return _upstream(0, shape) + _upstream(1, shape)


def _stacked(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([_upstream(0, shape), _upstream(1, shape)])


# name -> (function, rank r's input, r -> (expected output, expected input gradient))
CASES = {
    "copy_to_tp": (copy_to_tp, lambda r: _t(10 + r), lambda r: (_t(10 + r), _both(FULL))),
    "reduce_from_tp": (reduce_from_tp, lambda r: _t(10 + r), lambda r: (_t(10) + _t(11), _upstream(r, FULL))),
    "gather_from_tp": (gather_from_tp, lambda r: _shard(_t(10), r, -1),
                       lambda r: (_t(10), _shard(_upstream(r, FULL), r, -1))),
    "gather_from_sp": (gather_from_sp, lambda r: _shard(_t(10), r, 0), lambda r: (_t(10), _shard(_both(FULL), r, 0))),
    "reduce_scatter_to_sp": (reduce_scatter_to_sp, lambda r: _t(10 + r),
                             lambda r: (_shard(_t(10) + _t(11), r, 0), _stacked(HALF))),
    "scatter_to_sp": (scatter_to_sp, lambda r: _t(10), lambda r: (_shard(_t(10), r, 0), _stacked(HALF))),
}


def _autograd_functions(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    results = {}
    for name, (fn, inputs, _) in CASES.items():
        x = inputs(rank).clone().requires_grad_()
        out = fn(x, dist.group.WORLD)
        out.backward(_upstream(rank, tuple(out.shape)))
        results[name] = (out.detach(), x.grad)
    return results


def _single_tensor_helpers(rank: int) -> dict[str, torch.Tensor]:
    """Both helpers, blocking and asynchronous (as the grad buffer uses them)."""
    results = {}
    for async_op in (False, True):
        gathered, scattered = torch.empty(FULL), torch.empty(HALF)
        works = [all_gather_single(gathered, _shard(_t(10), rank, 0).contiguous(), dist.group.WORLD, async_op),
                 reduce_scatter_single(scattered, _t(10 + rank), dist.group.WORLD, async_op)]
        for work in works:
            if async_op:
                work.wait()
        results[f"gather async={async_op}"], results[f"scatter async={async_op}"] = gathered, scattered
    return results


def _indivisible_sequence(rank: int) -> str:
    try:
        reduce_scatter_to_sp(torch.zeros(3, 2, 6), dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"


def _helpers_before_torch_2_13(rank: int) -> dict[str, torch.Tensor]:
    """The helpers where torch.distributed has no *_single collectives (torch 2.11 on the GPU machines)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("all_gather_single", "reduce_scatter_single"):
            patch.delattr(dist, name, raising=False)
        return _single_tensor_helpers(rank)


def _on_rank(rank: int, world_size: int) -> dict:
    return {"autograd": _autograd_functions(rank), "helpers": _single_tensor_helpers(rank),
            "helpers before 2.13": _helpers_before_torch_2_13(rank), "indivisible": _indivisible_sequence(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """One spawn of 2 gloo ranks runs every case."""
    return run_ranks(WORLD, _on_rank)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_equal_one_process(ranks, name):
    for rank, result in enumerate(ranks):
        out, grad = result["autograd"][name]
        want_out, want_grad = CASES[name][2](rank)
        assert torch.allclose(out, want_out, atol=1e-6, rtol=0), f"forward, rank {rank}"
        assert torch.allclose(grad, want_grad, atol=1e-6, rtol=0), f"backward, rank {rank}"


@pytest.mark.parametrize("torch_version", ["helpers", "helpers before 2.13"])
def test_single_tensor_helpers_gather_along_dim0_and_sum_scatter(ranks, torch_version):
    for rank, result in enumerate(ranks):
        for async_op in (False, True):
            assert torch.equal(result[torch_version][f"gather async={async_op}"], _t(10))
            want = _shard(_t(10) + _t(11), rank, 0)
            assert torch.allclose(result[torch_version][f"scatter async={async_op}"], want, atol=1e-6, rtol=0)


def test_sequence_not_divisible_by_group_is_refused_by_name(ranks):
    for result in ranks:
        assert result["indivisible"] == "sequence length 3 is not divisible by tensor-parallel size 2"


@pytest.mark.parametrize("name", list(CASES))
def test_group_of_one_is_the_identity(name):
    """tp=1 pays nothing: no autograd node, the same tensor back."""
    x = _t(10)
    assert CASES[name][0](x, None) is x
