"""FP8 at every layout computes the one device's scales: a column- and a row-parallel linear on four ranks, tp 2
(with and without sequence parallelism) x cp 2 (each cp rank holding half of the tokens), quantise every operand
of every matmul with the one device's scales bit for bit, under each recipe (the amax reduced over the ranks
holding the rest of a tile: parallel/fp8/sharded.py), give its outputs and gradients, and post reductions that
pass the NCCL-rule replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import cpu_topology, metrics, pretrain_each, run_ranks

from megalite.dryrun.nccl_rules.record import CommRecorder
from megalite.dryrun.nccl_rules.replay import replay
from megalite.parallel.context import AxisView, ParallelContext
from megalite.parallel.fp8 import RECIPES
from megalite.parallel.gemm import apply_recipe
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear

HIDDEN, FFN, TOKENS = 256, 256, 256  # every per-rank width and token count whole 128-tiles (blockwise)
CASES = [(name, sp) for name in sorted(RECIPES) for sp in (False, True)]


class Recording:
    """An amax reduction that keeps what the one it wraps returns: (operand, matmul, amax) per call."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []

    def __call__(self, amax, operand, matmul, whole):
        agreed = self.inner(amax, operand, matmul, whole)
        self.seen.append((operand, matmul, agreed.clone()))
        return agreed


def _operands(kind: str) -> tuple[torch.Tensor, ...]:
    """The one device's x [tokens, 1, in], weight [out, in] and output gradient [tokens, 1, out] of a layer."""
    g = torch.Generator().manual_seed({"column": 0, "row": 1}[kind])
    inp, out = (HIDDEN, FFN) if kind == "column" else (FFN, HIDDEN)
    return (torch.randn(TOKENS, 1, inp, generator=g) * 3, torch.randn(out, inp, generator=g) * 0.05,
            torch.randn(TOKENS, 1, out, generator=g) * 1e-3)


def _run_layer(kind: str, name: str, ctx: ParallelContext, pieces) -> tuple[list, list[torch.Tensor]]:
    """One forward and backward of a `kind` layer at `ctx`'s layout on this rank's `pieces` (x, weight, grad):
    its recorded amaxes and [y, dx, dw]."""
    x, weight, grad = pieces
    layer_type = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = layer_type(x.shape[-1] * (ctx.tp.size if kind == "row" else 1), grad.shape[-1] * (
        ctx.tp.size if kind == "column" else 1), ctx, bias=False)
    return recorded_step(layer, name, x, weight, grad)


def recorded_step(layer: torch.nn.Module, name: str, x: torch.Tensor, weight: torch.Tensor,
                  grad: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
    """One forward and backward of `layer` (weight set to `weight`) under recipe `name` on x with output gradient
    grad: its recorded amaxes and [y, dx, dw]."""
    layer.weight.data.copy_(weight)
    apply_recipe(layer, RECIPES[name]())
    layer.recipe.amax = recording = Recording(layer.recipe.amax)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return recording.seen, [y.detach(), x.grad, layer.weight.grad]


def _local(kind: str, tp: tuple[int, int], cp: tuple[int, int], sp: bool,
           whole: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A rank's part of a layer's x, weight and grad (or of dx, dw and y, shaped alike) `whole`: the tokens cut in
    cp halves, then along the sequence over tp where SP splits them (a column-parallel layer's x, a row-parallel
    layer's output); the weight by tp."""
    x, weight, grad = whole[0].chunk(cp[1])[cp[0]], whole[1], whole[2].chunk(cp[1])[cp[0]]
    tokens_split = (lambda t: t.chunk(tp[1])[tp[0]]) if sp else (lambda t: t)
    if kind == "column":
        return tokens_split(x), weight.chunk(tp[1], 0)[tp[0]], grad.chunk(tp[1], -1)[tp[0]]
    return x.chunk(tp[1], -1)[tp[0]], weight.chunk(tp[1], 1)[tp[0]], tokens_split(grad)


def _ranks(rank: int, world_size: int) -> list:
    topology = cpu_topology(rank, world_size, tp=2, cp=2)
    tp, cp = (topology.tp_rank, 2), (topology.cp_rank, 2)
    results = []
    for name, sp in CASES:
        ctx = ParallelContext.from_topology(topology, sp, seed=0)
        with CommRecorder(rank) as recorder:
            layers = {kind: _run_layer(kind, name, ctx, _local(kind, tp, cp, sp, _operands(kind)))
                      for kind in ("column", "row")}
        results.append((tp, cp, layers, recorder.record))
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(4, _ranks, observed_groups=True)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_scale_and_result_is_the_one_devices(per_rank, case):
    """Every amax a rank's scales come from is the one device's (its part of the tiles) bit for bit; outputs
    and input gradients equal the one device's, and the weight gradients summed over the cp ranks (as the
    gradient reduction sums them) too, to fp32 rounding; the reductions pass the NCCL-rule replay."""
    name, sp = CASES[case]
    for kind in ("column", "row"):
        one_device, (y, dx, dw) = _run_layer(kind, name, ParallelContext(), _operands(kind))
        summed = {}
        for tp, cp, layers, _ in (results[case] for results in per_rank):
            seen, (my_y, my_dx, my_dw) = layers[kind]
            coords = {"tp": tp, "cp": cp}
            splits = ParallelContext(tp=AxisView(None, *tp), cp=AxisView(None, *cp)).operand_splits(
                **({"out": "tp"} if kind == "column" else {"in_": "tp"}))
            assert [key[:2] for key in seen] == [key[:2] for key in one_device], (name, kind)
            for (operand, matmul, amax), (_, _, reference) in zip(seen, one_device):
                where = (name, sp, kind, operand, matmul, tp, cp)
                assert torch.equal(amax, _part(reference, amax, splits.axes(operand, matmul), coords)), where
            local_dx, _, local_y = _local(kind, tp, cp, sp, (dx, dw, y))
            torch.testing.assert_close(my_y, local_y, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(my_dx, local_dx, rtol=1e-5, atol=1e-9)
            summed[tp] = summed.get(tp, 0) + my_dw
        for tp, my_dw in summed.items():
            torch.testing.assert_close(my_dw, _local(kind, tp, (0, 1), sp, (dx, dw, y))[1], rtol=1e-5, atol=1e-9)
    report = replay([results[case][3] for results in per_rank])
    assert report.ok and report.calls > 0, report.text()


def _part(reference: torch.Tensor, mine: torch.Tensor, axes: tuple[str | None, ...], coords: dict) -> torch.Tensor:
    """The part of the one device's amax `reference` a rank holding `mine` holds: each dimension it holds part
    of cut along the axis that splits it."""
    for dim, axis in enumerate(axes):
        if reference.shape[dim] != mine.shape[dim]:
            reference = reference.chunk(coords[axis][1], dim)[coords[axis][0]]
    return reference


# Whole models: each recipe in fp32 mode (FP8 matmuls, fp32 elsewhere) at every layout of two ranks reproduces
# the one device's losses. Under blockwise every per-rank width and token count is whole 128-tiles: 512 tokens a
# micro batch, so each SP shard holds 256 and each cp half-chunk 128; the other recipes take any shape, and a
# smaller one. Adam with eps 1 steps about lr * gradient (no sign-like first step that would turn a gradient
# element's rounding into a whole step).
RUN = ["--model.family=llama", "--model.num_layers=2", "--model.num_attention_heads=2",
       "--model.num_query_groups=2", "--model.vocab_size=256", "--train.micro_batch_size=1",
       "--train.global_batch_size=2", "--train.train_iters=2", "--train.precision=fp32", "--optim.lr=1e-3",
       "--optim.adam_eps=1.0", "--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true",
       "--data.num_workers=0", "--train.device=cpu"]
SHAPES = {"blockwise": ["--model.hidden_size=256", "--model.ffn_hidden_size=512", "--model.seq_length=512",
                        "--model.moe_ffn_hidden_size=128"],
          "tensorwise": ["--model.hidden_size=128", "--model.ffn_hidden_size=256", "--model.seq_length=128",
                         "--model.moe_ffn_hidden_size=64"]}
SHAPES["rowwise"] = SHAPES["tensorwise"]
EXPERTS = ["--model.num_experts=4", "--model.moe_topk=2", "--model.moe_first_dense_layers=1"]
# layout: (with experts, its arguments, whether it changes how fp32 sums are ordered)
LAYOUTS = {
    "tp2 SP": (False, ["--parallel.tp=2", "--parallel.sequence_parallel=true"], True),
    "pp2": (False, ["--parallel.pp=2"], False),
    "cp2": (False, ["--parallel.cp=2"], True),
    "dp2, distributed optimizer": (False, ["--parallel.distributed_optimizer=true"], False),
    "dp2, ZeRO-3": (False, ["--parallel.zero_stage=3"], False),
    "experts: tp2 SP x ep2": (True, ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2"],
                              True),
}
# Every rank running every expert on its own chunks of the sequences: an expert's tokens of a micro batch split
# over the cp ranks (their amax reduced over them). Not under blockwise: an expert's 128-row tiles along the
# tokens would hold other tokens than one device's (the rows each rank routes are data-dependent).
SPLIT_EXPERTS = {"experts: cp2 (ep1)": (True, ["--parallel.cp=2"], True)}


def _args(recipe: str, experts: bool, *extra: str) -> list[str]:
    return [*RUN, *SHAPES[recipe], *(EXPERTS if experts else []), *extra, f"--train.fp8_recipe={recipe}"]


def _with_metrics(root: Path, runs: dict[str, list[str]]) -> list[list[str]]:
    return [[*args, f"--logging.metrics_file={root}/{_file(name)}.jsonl"] for name, args in runs.items()]


def _file(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


@pytest.fixture(scope="module")
def model_runs(tmp_path_factory):
    """Every recipe's one-device runs (dense and with experts) on one spawned rank, then every layout of every
    recipe on one group of two: {run name: its step losses}."""
    root = tmp_path_factory.mktemp("fp8")
    references = {f"{recipe} one device {experts}": _args(recipe, experts)
                  for recipe in RECIPES for experts in (False, True)}
    layouts = {f"{recipe} {layout}": _args(recipe, experts, *extra)
               for recipe in RECIPES for layout, (experts, extra, _) in _layouts(recipe).items()}
    run_ranks(1, pretrain_each, _with_metrics(root, references))
    run_ranks(2, pretrain_each, _with_metrics(root, layouts))
    return {name: [r["loss"] for r in metrics(root / f"{_file(name)}.jsonl")] for name in [*references, *layouts]}


def _layouts(recipe: str) -> dict:
    return LAYOUTS if recipe == "blockwise" else LAYOUTS | SPLIT_EXPERTS


@pytest.mark.parametrize(("recipe", "layout"), [(recipe, layout) for recipe in sorted(RECIPES)
                                                for layout in _layouts(recipe)])
def test_each_recipe_at_each_layout_reproduces_the_one_device_run(model_runs, recipe, layout):
    """Layouts whose ranks sum in the one device's order (pp, dp, ZeRO-3) give its losses to 1e-6. Those that
    sum partial products (tp's row-parallel layers, cp's attention) differ in fp32 rounding, and where that
    moves a value across an FP8 rounding boundary, the value moves by an FP8 step (1/8 to 1/4 of itself): step
    1's loss within 1e-5, step 2's within 2e-4 (a missing amax reduction moves step 1 by 5e-5 to 3e-4)."""
    experts, _, reorders = _layouts(recipe)[layout]
    reference, losses = model_runs[f"{recipe} one device {experts}"], model_runs[f"{recipe} {layout}"]
    assert len(reference) == len(losses) == 2
    assert losses[0] == pytest.approx(reference[0], rel=1e-5 if reorders else 1e-6)
    assert losses[1] == pytest.approx(reference[1], rel=2e-4 if reorders else 1e-6)
