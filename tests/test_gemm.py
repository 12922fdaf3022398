"""The matmul hook (parallel/gemm.py) and the way out for auxiliary losses (model/aux_losses.py).

- Through `gemm.linear`, output and input gradient are F.linear's; with a gradient buffer's sink on the
  weight, dW is added straight into the fp32 main gradient (accumulating over micro batches) and nothing
  is handed to autograd; bf16 operands are accumulated in fp32, not rounded to bf16 first, also while a
  weight's first reader's gradient waits for its last (a tied embedding).
- Under sequence parallelism the backward runs in Megatron-LM's order, each collective launched before a
  matmul and awaited after it (2 gloo ranks).
- An auxiliary loss attached on a middle pipeline stage reaches backward there: a pp=2 run with such a
  term equals the one-device run with it, and the term does change the gradients.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

from megalite.config import ModelConfig
from megalite.model.aux_losses import AuxLosses
from megalite.model.gpt import GPTModel, TransformerLayer
from megalite.model.moe.experts import ExpertLinear
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.grad_buffer import GradBuffer
from megalite.parallel.layers import ColumnParallelLinear
from megalite.parallel.weight_grads import set_sink


class _Sink:
    """A gradient sink that adds every gradient into `main` and counts the deposits."""

    def __init__(self, main: torch.Tensor, calls: list[int]) -> None:
        self.main, self.calls = main, calls

    def deposit(self, param: torch.Tensor, add) -> None:
        add(self.main)
        self.calls.append(1)


def test_weight_gradient_goes_into_the_fp32_main_gradient():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((3, 5, 8), (6, 8), (6,)))
    reference = [t.clone().requires_grad_() for t in (x, w, b)]
    out = F.linear(*reference)
    out.square().sum().backward()

    x1, w1, b1 = (t.clone().requires_grad_() for t in (x, w, b))
    main, calls = torch.full((6, 8), 0.5), []
    set_sink(w1, _Sink(main, calls))
    for _ in range(2):  # two micro batches accumulate
        y = gemm.linear(x1, w1, b1)
        y.square().sum().backward()
    assert torch.allclose(y, out, atol=1e-6) and calls == [1, 1] and w1.grad is None
    assert torch.allclose(main, 0.5 + 2 * reference[1].grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(x1.grad, 2 * reference[0].grad, rtol=1e-6) and torch.allclose(b1.grad, 2 * reference[2].grad)

    w2 = w.clone().requires_grad_()  # no sink (no buffer): autograd gets dW as usual
    gemm.linear(x, w2).square().sum().backward()
    assert torch.allclose(w2.grad, F.linear(x, w).mul(2).flatten(0, 1).t().matmul(x.flatten(0, 1)), rtol=1e-5)


def test_bf16_operands_accumulate_in_fp32():
    """Under bf16 autocast the matmuls run in bf16, but dW = grad^T x is summed in fp32 into the main gradient:
    exactly the fp32 product of the bf16 operands, where autograd's dW would be rounded to bf16 first."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 32, generator=g), torch.randn(16, 32, generator=g).requires_grad_()
    main, calls = torch.zeros(16, 32), []
    set_sink(w, _Sink(main, calls))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gemm.linear(x, w)
    grad = torch.randn(y.shape, generator=g).to(torch.bfloat16)
    y.backward(grad)
    exact = grad.float().t() @ x.to(torch.bfloat16).float()
    assert y.dtype == torch.bfloat16 and calls == [1]
    assert torch.allclose(main, exact, rtol=1e-6, atol=1e-6)
    rounded = (grad.t() @ x.to(torch.bfloat16)).float()  # what a bf16 dW would have been
    assert not torch.equal(rounded, exact)

    # A weight read twice in one backward (a tied embedding and the LM head): the first gradient waits beside the
    # buffer, in fp32 too, until the last one, which the buffer then counts once.
    tied = nn.Parameter(w.detach().clone())
    buffer, calls = GradBuffer([tied], 1024, None, 1, 0, 0, False, reads={id(tied): 2}), []
    buffer.on_grads_in = calls.append
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = gemm.linear(x, tied)
        y.backward(grad)
        if not calls:
            waiting = buffer.waiting[id(tied)]
    assert len(calls) == 1 and waiting.dtype == torch.float32 and torch.allclose(waiting, exact, rtol=1e-6, atol=1e-6)
    assert torch.allclose(tied.main_grad, 2 * exact, rtol=1e-6, atol=1e-6) and tied.grad is None


class _Recorded:
    """A collective's work that notes when it is waited on."""

    def __init__(self, work, name: str, events: list[str]) -> None:
        self.work, self.name, self.events = work, name, events

    def wait(self) -> None:
        self.events.append(f"wait {self.name}")
        self.work.wait()


def _noted(name: str, fn, events: list[str]):
    def call(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)
    return call


class _NotedMatmuls(gemm.HighPrecision):
    """High precision, noting each gradient matmul in `events`."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def linear_input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.events.append("dX matmul")
        return super().linear_input_grad(grad, weight)

    def linear_weight_grad(self, grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.events.append("dW matmul")
        return super().linear_weight_grad(grad, x, out)


def _sequence_parallel_backward(rank: int, world_size: int) -> tuple[list[str], bool]:
    """A column-parallel matmul on a sequence-parallel input (4 local rows, 6 local outputs) and its backward,
    every step of gemm's backward noted in order; and whether its gradients equal the one-device ones."""
    events, gather, scatter = [], gemm.all_gather_single, gemm.start_reduce_scatter_rows

    def start_scatter(*args, **kwargs):
        out, work = scatter(*args, **kwargs)
        return out, _Recorded(work, "reduce-scatter dX", events)

    gemm.all_gather_single = _noted("all-gather x", lambda *a, **k: _Recorded(gather(*a, **k), "all-gather x", events),
                                    events)
    gemm.start_reduce_scatter_rows = _noted("reduce-scatter dX", start_scatter, events)
    g = torch.Generator().manual_seed(0)
    x, w, grad = torch.randn(8, 2, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(8, 2, 12, generator=g)
    rows, cols = slice(4 * rank, 4 * rank + 4), slice(6 * rank, 6 * rank + 6)
    local_x, local_w = x[rows].clone().requires_grad_(), w[cols].clone().requires_grad_()
    gemm.linear(local_x, local_w, gather_group=dist.group.WORLD, recipe=_NotedMatmuls(events)).backward(grad[..., cols])
    equal = (torch.allclose(local_x.grad, (grad @ w)[rows], atol=1e-5)
             and torch.allclose(local_w.grad, grad[..., cols].flatten(0, 1).t() @ x.flatten(0, 1), atol=1e-5))
    return events, equal


def test_sequence_parallel_backward_overlaps_both_collectives_as_megatron_does():
    """Megatron-LM's order: the input's all-gather is launched before the input-gradient matmul and awaited
    after it; the input gradient's reduce-scatter is launched before the weight-gradient matmul and awaited
    after it, so each collective runs beside a matmul. The gradients are the one-device ones."""
    order = ["all-gather x", "dX matmul", "wait all-gather x",
             "reduce-scatter dX", "dW matmul", "wait reduce-scatter dX"]
    for events, equal in run_ranks(2, _sequence_parallel_backward):
        assert events == order and equal


class _RoundedAndCounted(gemm.HighPrecision):
    """A recipe of the test's own: operands rounded to bf16's precision (kept in fp32) before the forward matmul,
    and every call counted by method name."""

    def __init__(self) -> None:
        self.calls = collections.Counter()

    def linear(self, x, weight, bias):
        self.calls["linear"] += 1
        return super().linear(_rounded(x), _rounded(weight), bias)

    def linear_input_grad(self, grad, weight):
        self.calls["linear_input_grad"] += 1
        return super().linear_input_grad(grad, weight)

    def linear_weight_grad(self, grad, x, out=None):
        self.calls["linear_weight_grad"] += 1
        return super().linear_weight_grad(grad, x, out)

    def grouped(self, x, weight, groups):
        self.calls["grouped"] += 1
        return super().grouped(_rounded(x), _rounded(weight), groups)

    def grouped_input_grad(self, grad, weight, groups):
        self.calls["grouped_input_grad"] += 1
        return super().grouped_input_grad(grad, weight, groups)

    def grouped_weight_grad(self, grad, x, groups):
        self.calls["grouped_weight_grad"] += 1
        return super().grouped_weight_grad(grad, x, groups)


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def test_a_recipe_applied_to_a_built_model_runs_its_dense_and_expert_matmuls():
    """apply_recipe gives the transformer layers a recipe defined here: every dense linear (attention, the dense
    MLP) and every grouped expert matmul runs its forward, input gradient and weight gradient through it, once
    per matmul; the router and the LM head keep the default."""
    cfg = ModelConfig(family="llama", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                      vocab_size=64, num_experts=4, moe_topk=2, moe_ffn_hidden_size=16, moe_first_dense_layers=1)
    model = GPTModel(cfg, torch.device("cpu"), seed=0)
    recipe = _RoundedAndCounted()
    gemm.apply_recipe(model.layers, recipe)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).sum().backward()
    dense = 2 + 2 + 2  # attention's qkv and output projections in both layers, the dense layer's MLP
    grouped = 2  # the experts' two projections
    assert recipe.calls == {"linear": dense, "linear_input_grad": dense, "linear_weight_grad": dense,
                            "grouped": grouped, "grouped_input_grad": grouped, "grouped_weight_grad": grouped}
    assert model.lm_head.recipe is gemm.HIGH_PRECISION


def test_a_recipe_decides_how_dense_and_grouped_operands_are_cast():
    """The same recipe rounds the operands of a column-parallel layer and of the experts' grouped matmul."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    dense, experts = ColumnParallelLinear(32, 16, ParallelContext(), bias=False), ExpertLinear(2, 32, 16, dim=1)
    for layer in (dense, experts):
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
        gemm.apply_recipe(layer, _RoundedAndCounted())
    w, offsets = experts.weight, torch.tensor([2, 5], dtype=torch.int32)
    assert torch.equal(dense(x), F.linear(_rounded(x), _rounded(dense.weight)))
    by_hand = torch.cat([F.linear(_rounded(x[:2]), _rounded(w[0])), F.linear(_rounded(x[2:]), _rounded(w[1]))])
    torch.testing.assert_close(experts(x, offsets), by_hand)
    assert not torch.allclose(dense(x), F.linear(x, dense.weight), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(experts(x, offsets), gemm.grouped_linear(x, w, offsets), rtol=1e-4, atol=1e-4)


def test_an_attached_loss_gets_the_step_scale_as_gradient():
    losses = AuxLosses()
    losses.start_step(0.25, torch.device("cpu"))
    x = torch.ones(3, requires_grad=True)
    a = torch.tensor(2.0, requires_grad=True)
    y = losses.attach("toy", x * 3, (a * a) / 2)
    assert torch.equal(y, x * 3) and y.data_ptr() != x.data_ptr() and losses.totals["toy"] == 2.0
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0)) and a.grad == 0.25 * 2.0


AUX = 1.0
ARGS = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8", "--model.seq_length=32",
        "--model.vocab_size=250", "--model.family=llama", "--model.num_query_groups=4", "--train.micro_batch_size=1",
        "--train.global_batch_size=4", "--train.train_iters=4", "--optim.lr=3e-3", "--logging.progress_bar=false",
        "--data.mock=true", "--data.num_workers=0", "--train.device=cpu"]


def _grad_norms(rank: int, world_size: int, args: list[str], aux: bool, metrics: str) -> list[float]:
    """One run in this spawned rank (its gradient norms, known on the last rank); with `aux`, every transformer
    layer adds AUX * mean((output - 1)^2) as an auxiliary loss (layers 0-1 sit on the first of two pipeline stages,
    where no loss of its own reaches backward)."""
    import json
    import os

    from megalite.config_cli import parse_config
    from megalite.training.pretrain import pretrain

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if aux:
        forward = TransformerLayer.forward

        def with_loss(self, x, rope, cache=None):
            out = forward(self, x, rope, cache)
            return self.aux_losses.attach("toy", out, AUX * (out.float() - 1).square().mean())

        TransformerLayer.forward = with_loss
    pretrain(parse_config([*args, f"--logging.metrics_file={metrics}", "--logging.log_interval=1"]))
    if rank != world_size - 1:
        return []
    return [json.loads(line)["grad_norm"] for line in open(metrics) if "grad_norm" in line]


def test_auxiliary_losses_reach_backward_on_every_pipeline_stage(tmp_path):
    """pp=2 with 4 micro batches, each stage's layers adding the term: every step's gradient norm equals the
    one-device run's with the term (so the first stage's terms reached its backward), and differs from the run
    without it."""
    plain = run_ranks(1, _grad_norms, ARGS, False, str(tmp_path / "plain.jsonl"))[0]
    one = run_ranks(1, _grad_norms, ARGS, True, str(tmp_path / "one.jsonl"))[0]
    two = run_ranks(2, _grad_norms, [*ARGS, "--parallel.pp=2"], True, str(tmp_path / "two.jsonl"))[-1]
    assert len(two) == 4 and two == pytest.approx(one, rel=1e-5)
    assert one != pytest.approx(plain, rel=1e-2)
