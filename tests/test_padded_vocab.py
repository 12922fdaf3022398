"""The LM head multiplies by the whole padded weight (GEMM shapes stay multiples of the padding, the
point of padding) and masks the padded columns: losses, logits and gradients equal plain torch over
the real vocabulary only, and the padded weight rows get exactly zero gradient, at tp=1 and tp=2."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

from megalite.config import ModelConfig
from megalite.model.head import LMHead
from megalite.parallel.context import ParallelContext

HIDDEN, SEQ, BATCH = 64, 8, 3


def _padded(vocab: int) -> int:
    cfg = ModelConfig()
    cfg.vocab_size = vocab
    return cfg.padded_vocab_size


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    """Same on every rank. Padded weight rows are large, so any leak into the softmax shows."""
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(_padded(vocab), HIDDEN, generator=gen) * 0.3
    weight[vocab:] *= 30
    return {"weight": weight, "x": torch.randn(SEQ, BATCH, HIDDEN, generator=gen),
            "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
            "loss_grad": torch.rand(BATCH, SEQ, generator=gen),
            "logit_grad": torch.randn(BATCH, SEQ, vocab, generator=gen)}


def _autocast(bf16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _backward(out: torch.Tensor, inputs: dict[str, torch.Tensor], with_labels: bool) -> None:
    (out.float() * inputs["loss_grad" if with_labels else "logit_grad"]).sum().backward()


def _reference(inputs: dict[str, torch.Tensor], vocab: int, with_labels: bool, bf16: bool) -> dict[str, torch.Tensor]:
    """Plain torch over the real vocabulary rows only: output, grad of x, grad of the whole padded weight."""
    weight = inputs["weight"].clone().requires_grad_()
    x = inputs["x"].clone().requires_grad_()
    with _autocast(bf16):
        logits = F.linear(x.transpose(0, 1), weight[:vocab])
        out = logits
        if with_labels:
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            out = -log_probs.gather(-1, inputs["labels"].unsqueeze(-1)).squeeze(-1)
    _backward(out, inputs, with_labels)
    return {"out": out.detach(), "grad x": x.grad, "grad weight": weight.grad}


def _head_run(inputs: dict[str, torch.Tensor], vocab: int, with_labels: bool, bf16: bool, ctx: ParallelContext,
              ) -> dict[str, torch.Tensor]:
    """The LMHead on this rank's weight shard (and sequence slice under SP); gradients of the full x
    (reassembled under SP) and of this rank's weight rows."""
    rows = inputs["weight"].shape[0] // ctx.tp.size
    head = LMHead(HIDDEN, inputs["weight"].shape[0], vocab, ctx, owns_weight=True)
    with torch.no_grad():
        head.weight.copy_(inputs["weight"][ctx.tp.rank * rows : (ctx.tp.rank + 1) * rows])
    x = inputs["x"].clone().requires_grad_()
    local = x.chunk(ctx.tp.size)[ctx.tp.rank] if ctx.sequence_parallel else x
    with _autocast(bf16):
        out = head(local, inputs["labels"] if with_labels else None)
    _backward(out, inputs, with_labels)
    grad_x = x.grad
    if ctx.sequence_parallel:  # each rank only has its sequence slice's gradient
        dist.all_reduce(grad_x, group=ctx.tp.group)
    return {"out": out.detach(), "grad x": grad_x, "grad weight": head.weight.grad}


def _mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bf16: bool, what: str) -> list[str]:
    """Errors are relative to each tensor's largest value (at least 1): the padded GEMM sums in another
    order than the sliced reference, so fp32 results differ by rounding (~1e-7), bf16 ones by an ulp."""
    failures, tolerance = [], 1e-2 if bf16 else 1e-6
    for key, value in got.items():
        if value.shape != want[key].shape:
            failures.append(f"{what} {key}: shape {tuple(value.shape)} vs {tuple(want[key].shape)}")
            continue
        error = (value.float() - want[key].float()).abs().max().item()
        if error > tolerance * max(1.0, want[key].abs().max().item()):
            failures.append(f"{what} {key}: {error}")
    return failures


@pytest.fixture
def matmul_shapes(monkeypatch) -> list[tuple[int, ...]]:
    """Shapes of every tensor handed to F.linear or torch.mm while the fixture is active."""
    shapes, linear, mm = [], F.linear, torch.mm

    def record(fn):
        def recorded(*args, **kwargs):
            shapes.extend(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs)
        return recorded

    monkeypatch.setattr(F, "linear", record(linear))
    monkeypatch.setattr(torch, "mm", record(mm))
    return shapes


@pytest.mark.parametrize("with_labels", [True, False])
def test_head_multiplies_the_whole_padded_weight(matmul_shapes, with_labels):
    vocab = 250
    inputs = _inputs(vocab)
    _head_run(inputs, vocab, with_labels, bf16=False, ctx=ParallelContext())
    weights = [s for s in matmul_shapes if _padded(vocab) in s]
    assert weights, matmul_shapes
    assert not [s for s in matmul_shapes if vocab in s], matmul_shapes


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("with_labels", [True, False])
def test_head_matches_real_vocabulary_reference(with_labels, bf16):
    vocab = 250
    inputs = _inputs(vocab)
    got = _head_run(inputs, vocab, with_labels, bf16, ParallelContext())
    want = _reference(inputs, vocab, with_labels, bf16)
    assert got["out"].shape == ((BATCH, SEQ) if with_labels else (BATCH, SEQ, vocab))
    assert got["out"].dtype == (torch.float32 if with_labels or not bf16 else torch.bfloat16)
    assert torch.equal(got["grad weight"][vocab:], torch.zeros_like(got["grad weight"][vocab:]))
    assert _mismatches(got, want, bf16, "tp=1") == []


def _tp_run(rank: int, world_size: int) -> list[str]:
    # vocab 250 pads to 256: the last rank's slice ends in 6 padded rows; vocab 100 leaves rank 1 all padding
    failures = []
    for vocab in (250, 100):
        inputs = _inputs(vocab)
        rows = _padded(vocab) // world_size
        for sp in (False, True):
            tp = ParallelContext.tensor_parallel(dist.group.WORLD, rank, world_size, sequence_parallel=sp)
            for with_labels in (True, False):
                for bf16 in (False, True):
                    what = f"tp={world_size} vocab={vocab} sp={sp} labels={with_labels} bf16={bf16} rank={rank}"
                    got = _head_run(inputs, vocab, with_labels, bf16, tp)
                    want = _reference(inputs, vocab, with_labels, bf16)
                    want["grad weight"] = want["grad weight"][rank * rows : (rank + 1) * rows]
                    failures += _mismatches(got, want, bf16, what)
                    padded = got["grad weight"][max(0, vocab - rank * rows) :]
                    if not torch.equal(padded, torch.zeros_like(padded)):
                        failures.append(f"{what}: padded weight rows got a nonzero gradient")
    return failures


def test_vocab_parallel_head_masks_padding_on_the_last_rank():
    assert run_ranks(2, _tp_run) == [[], []]
