"""What FP8 keeps for backward (parallel/fp8/recipes.py): `tensorwise` keeps a linear's FP8 input and its scale
instead of x, and the weight gradient computed from them is the one computed from x bit for bit (under sequence
parallelism too: tests/test_fp8_layouts.py); `rowwise` and `blockwise` keep x. The planner's activation figures
count what is kept (tests/test_plan.py's measurement of saved tensors, FP8 cases)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import cpu_topology, run_ranks
from test_plan import PRECISIONS, _model_config, assert_zero_bubble_bytes_as_planned, one_device_model, saved_bytes
from test_plan_experts import FEATURES, block_config, block_saved_bytes, planned_block_bytes

from megalite.config import Config
from megalite.config_validation import validate
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.fp8 import RECIPES
from megalite.planning.memory import chunk_activation_bytes, chunk_held_bytes, peak_activations
from megalite.planning.plan import format_plan, make_plan
from megalite.training.build import build_model, build_trainer

DTYPES = {torch.float32: 4, torch.bfloat16: 2}


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [48, 2, 160], weight [144, 160] (fp32, as a parameter), output gradient [48, 2, 144]."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(48, 2, 160, generator=g) * 3, torch.randn(144, 160, generator=g) * 0.05
    return x.to(dtype), w, (torch.randn(48, 2, 144, generator=g) * 1e-3).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_kept_input_gives_the_weight_gradient_of_x_bit_for_bit(name, dtype):
    """A linear's forward keeps, under tensorwise, x's e4m3 copy and one fp32 scale (1 byte an element), under
    the other recipes x itself; its weight and input gradients equal those the recipe computes from x itself
    (x^T quantised anew) bit for bit."""
    x, w, g = _operands(dtype)
    recipe = RECIPES[name]()
    weight = w.clone().requires_grad_()
    inp = x.clone().requires_grad_()
    kinds = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kinds.append((t.dtype, t.numel())) or t, lambda t: t):
        y = gemm.linear(inp, weight, recipe=recipe)
    y.backward(g)
    rows = x.shape[0] * x.shape[1]
    expected_dw = recipe.linear_weight_grad(g.reshape(rows, -1), x.reshape(rows, -1)).to(w.dtype)
    assert torch.equal(weight.grad, expected_dw)
    assert torch.equal(inp.grad, recipe.linear_input_grad(g, w))
    keeps = [(torch.float8_e4m3fn, x.numel()), (torch.float32, 1)] if name == "tensorwise" else [(dtype, x.numel())]
    assert kinds == keeps
    assert recipe.kept_input_bytes(rows, 160, DTYPES[dtype]) == sum(
        numel * torch.empty(0, dtype=kind).element_size() for kind, numel in keeps)



def _config(family: str, recipe: str, precision: str, param_dtype: str, recompute: str, **parallel) -> Config:
    """test_plan's model (four layers, 64 tokens a sample, qwen3's heads 32 wide) under `recipe`."""
    cfg = _model_config(family, train={"precision": precision, "param_dtype": param_dtype, "recompute": recompute,
                                       "fp8_recipe": recipe}, parallel=parallel)
    cfg.model.seq_length, cfg.model.num_query_groups = 64, 2 if family != "gpt2" else None
    cfg.model.head_dim = 32 if family == "qwen3" else None
    return cfg


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
@pytest.mark.parametrize("precision,param_dtype", PRECISIONS)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_planned_fp8_activations_match_saved_tensors(family, precision, param_dtype, recompute):
    """Each recipe's saved bytes as planned (within test_plan's 1%) and what tensorwise saves over keeping x, to
    the byte: the linears' inputs in e4m3 with a scale each, the attention projection's FP8 copy kept beside the
    core's output unless the core is recomputed; rowwise keeps what no FP8 keeps."""
    measured, planned = {}, {}
    for recipe in ("none", "tensorwise", "rowwise"):
        cfg = _config(family, recipe, precision, param_dtype, recompute)
        measured[recipe] = saved_bytes(one_device_model(cfg), cfg)
        planned[recipe] = chunk_activation_bytes(cfg, 0, "cpu")[0]
        assert measured[recipe] == pytest.approx(planned[recipe], rel=0.01), recipe
    assert measured["none"] - measured["tensorwise"] == planned["none"] - planned["tensorwise"] > 0
    assert measured["rowwise"] == measured["none"] and planned["rowwise"] == planned["none"]


def _sequence_parallel_activations(rank: int, world_size: int, cfgs: list[Config]) -> list[tuple[int, int]]:
    torch.set_num_threads(1)
    measured = []
    for cfg in cfgs:
        with build_trainer(cfg, cpu_topology(rank, world_size, tp=world_size)) as parts:
            parts.model.train()
            measured.append((saved_bytes(parts.model, cfg), chunk_activation_bytes(cfg, 0, "cpu")[0]))
    return measured


def test_planned_fp8_activations_under_sequence_parallelism():
    """tp 2 with sequence parallelism: a column-parallel layer keeps its rank's rows of the FP8 copy (gathered
    again in backward), as planned, and tensorwise saves what the planner says to the byte."""
    cfgs = [_config("llama", recipe, "bf16", "fp32", "selective", tp=2, sequence_parallel=True)
            for recipe in ("none", "tensorwise")]
    for (plain, plain_planned), (fp8, fp8_planned) in run_ranks(2, _sequence_parallel_activations, cfgs):
        assert fp8 == pytest.approx(fp8_planned, rel=0.01)
        assert plain - fp8 == plain_planned - fp8_planned > 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_planned_fp8_weight_gradient_inputs_under_a_zero_bubble_schedule(family):
    """zb-h1 under tensorwise: a B leaves its W each linear's FP8 copy and scale (not x), as the planner counts
    (test_plan's zero-bubble measurement, within its 1% and 2%)."""
    cfg = _config(family, "tensorwise", "bf16", "fp32", "none")
    cfg.parallel.pipeline_schedule = "zb-h1"
    assert_zero_bubble_bytes_as_planned(cfg)
    unquantised = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8_recipe="none"))
    assert chunk_held_bytes(cfg, 0, "cpu")[0] < chunk_held_bytes(unquantised, 0, "cpu")[0]


def test_the_plan_shows_the_fp8_saving():
    """tools/plan.py's report: the recipe, its layers and the activations it saves against linear inputs kept
    in train.precision (none under rowwise)."""
    for recipe in ("tensorwise", "rowwise"):
        cfg = _config("llama", recipe, "bf16", "fp32", "none")
        validate(cfg, 1)
        plan = make_plan(cfg, 1)
        unquantised = peak_activations(dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, fp8_recipe="none")), 1, 0, "cuda")[0]
        saving = unquantised - plan.worst.activations
        assert (saving > 0) == (recipe == "tensorwise")
        assert (f"  FP8 {recipe} (4 of 4 layers): {saving / 2**30:.2f} GiB of activations saved against linear "
                f"inputs in bf16 ({unquantised / 2**30:.2f} GiB; ") in format_plan(plan)


@pytest.mark.parametrize("precision,param_dtype", PRECISIONS)
@pytest.mark.parametrize("features", FEATURES[:4], ids=lambda f: ",".join(f) or "default")
def test_planned_fp8_moe_block_activations_to_the_byte(precision, param_dtype, features):
    """An MoE block under tensorwise (test_plan_experts' block, to its bytes): the shared expert's fc1 keeps an FP8
    copy beside the input the gate or the router still keeps, or instead of the copy it would have cast; the
    routed experts keep their rows in the compute dtype."""
    cfg = block_config(precision, param_dtype, features)
    cfg.train.fp8_recipe = "tensorwise"
    validate(cfg, 1)
    model = build_model(cfg, torch.device("cpu"), ParallelContext(), 0).train()
    assert block_saved_bytes(model, cfg) == pytest.approx(planned_block_bytes(cfg), abs=16 * 8)
