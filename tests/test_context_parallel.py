"""Context-parallel attention equals full causal attention: every cp rank's output and its slices of
dq, dk, dv match one device's F.scaled_dot_product_attention over the global sequence, for both comms,
multi-head and grouped-query attention, with K/V expanded to every head for the block kernel or handed to
it per group (as on CUDA); and its communication obeys NCCL's rules (megalite/dryrun/nccl_rules/)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

from megalite.dryrun.nccl_rules.record import CommRecorder
from megalite.dryrun.nccl_rules.replay import replay
from megalite.parallel import context_parallel
from megalite.parallel.context_parallel import context_parallel_attention, local_positions

HEADS, BATCH, DIM = 4, 2, 16
# (comm, KV groups, sequence length, dtype)
CASES = [(comm, groups, seq, torch.float32) for comm in ("p2p", "allgather") for groups in (4, 2) for seq in (32, 64)]
CASES += [(comm, 2, 32, torch.bfloat16) for comm in ("p2p", "allgather")]


def _inputs(groups: int, seq: int) -> tuple[torch.Tensor, ...]:
    """The global q, k, v and upstream gradient of a case, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 * groups + seq)
    shapes = [(BATCH, HEADS, seq, DIM), (BATCH, groups, seq, DIM), (BATCH, groups, seq, DIM), (BATCH, HEADS, seq, DIM)]
    return tuple(torch.randn(shape, generator=gen) for shape in shapes)


def _seq_major(t: torch.Tensor) -> torch.Tensor:
    """The attention layer's layout: [b, h, s, d] viewed from [b, s, h, d] memory (not contiguous)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _cp_ranks(rank: int, world_size: int, grouped_kernel: bool = False) -> list:
    """Per case: this rank's output, dq, dk, dv (fp32) and its communication record; `grouped_kernel`: the CPU
    block kernel takes K/V per group, as CUDA's does (torch 2.13's CPU kernel can)."""
    if grouped_kernel:
        context_parallel.KERNELS_TAKING_GROUPS.add("cpu")  # a spawned process of its own: nothing to restore
    results = []
    for comm, groups, seq, dtype in CASES:
        positions = local_positions(seq, world_size, rank)
        q, k, v, grad = (_seq_major(t.index_select(2, positions).to(dtype)) for t in _inputs(groups, seq))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with CommRecorder(rank) as recorder:
            out = context_parallel_attention(q, k, v, dist.group.WORLD, comm=comm)
            out.backward(grad)
        results.append(([t.detach().float() for t in (out, q.grad, k.grad, v.grad)], recorder.record))
    return results


def _reference(groups: int, seq: int) -> list[torch.Tensor]:
    q, k, v, grad = _inputs(groups, seq)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != HEADS)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _assert_matches_one_device(per_rank: list) -> None:
    cp = len(per_rank)
    for index, (comm, groups, seq, dtype) in enumerate(CASES):
        case = f"cp={cp} {comm} groups={groups} seq={seq} {dtype}"
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=5e-2)
        expected = _reference(groups, seq)
        for rank in range(cp):
            got, _ = per_rank[rank][index]
            local = [t.index_select(2, local_positions(seq, cp, rank)) for t in expected]
            for name, g, e in zip(("out", "dq", "dk", "dv"), got, local):
                where = f"{case} rank {rank} {name}"
                torch.testing.assert_close(g, e, **tol, msg=lambda m, where=where: f"{where}: {m}")
        report = replay([results[index][1] for results in per_rank])
        assert report.ok, f"{case}:\n{report.text()}"
        assert report.messages > 0 or comm == "allgather", case


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_matches_one_device(cp):
    _assert_matches_one_device(run_ranks(cp, _cp_ranks, observed_groups=True))


def test_attention_matches_one_device_with_kv_per_group_at_the_kernel():
    """CUDA's path: the block kernel gets grouped K/V as they are, no copy per head."""
    _assert_matches_one_device(run_ranks(2, _cp_ranks, True, observed_groups=True))


def assert_kv_per_group_gives_the_same(monkeypatch, device: torch.device, dtype: torch.dtype, causal: bool,
                                      seq: int = 8, dim: int = DIM) -> None:
    """One block through `device`'s kernel with K/V handed over per group (no copy reaches the kernel) and
    expanded to every head: the same output, log-sum-exp and gradients (bit for bit, except bf16 dK/dV,
    which differ by rounding where the kernel sums a group's heads in fp32 and _fold in bf16)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(BATCH, HEADS, seq, dim, device=device, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(BATCH, 2, seq, dim, device=device, generator=gen).to(dtype) for _ in range(2))
    results = []
    for kernels in (set(), {device.type}):
        monkeypatch.setattr(context_parallel, "KERNELS_TAKING_GROUPS", kernels)
        assert (context_parallel._for_kernel(k, HEADS) is k) == bool(kernels)
        out, lse, meta = context_parallel._flash_forward(q, k, v, causal)
        results.append((out, lse, *context_parallel._flash_backward(dout, q, k, v, out, lse, causal, meta)))
    for name, expanded, grouped in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert grouped.shape == expanded.shape, name
        if dtype == torch.float32 or name in ("out", "lse", "dq"):
            assert torch.equal(grouped, expanded), name
        else:
            torch.testing.assert_close(grouped, expanded, rtol=0, atol=5e-2, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_give_the_same_with_kv_per_group_or_per_head(monkeypatch, dtype, causal):
    assert_kv_per_group_gives_the_same(monkeypatch, torch.device("cpu"), dtype, causal)


def test_local_positions_pair_mirrored_chunks():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp, seq in ((1, 6), (2, 16), (4, 32), (4, 64)):
        held = torch.cat([local_positions(seq, cp, rank) for rank in range(cp)])
        assert held.dtype == torch.long and sorted(held.tolist()) == list(range(seq))


def test_local_positions_refuses_uneven_chunks():
    with pytest.raises(ValueError, match="divisible by 2 \\* parallel.cp = 8"):
        local_positions(36, 4, 0)
