"""FP8 recipes (parallel/fp8/): each recipe's forward, input gradient and weight gradient, dense and grouped, equal
an independent quantise-dequantise reference in fp32 (written here tile by tile, from the recipes' definitions:
formats, tiles, powers of two), with the scales bit for bit; torch._scaled_mm's CPU kernel equals the emulation
bit for bit where it takes the scales; the validator's refusals; a tiny MoE model trains with each recipe close to
fp32; an FP8 run's checkpoint resumes without FP8. That apply_recipe reaches every dense and expert matmul of the
transformer layers (and not the head or the routers) is tests/test_gemm.py's."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import metrics, pretrain_each, run_ranks

from megalite.config import ConfigError
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.parallel import gemm
from megalite.parallel.fp8 import RECIPES
from megalite.parallel.fp8.recipes import kernel_for, kernel_mm
from megalite.parallel.weight_grads import set_sink
from megalite.training.run_summary import fp8_line

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
# Each recipe's definition, as issue 38 states it: (format, tile rows, tile columns along the contraction) of the
# input, the weight and the output gradient (None: the whole dimension), and whether scales are powers of two.
SPEC = {
    "tensorwise": ({"input": (E4M3, None, None), "weight": (E4M3, None, None), "grad": (E5M2, None, None)}, False),
    "rowwise": ({"input": (E4M3, 1, None), "weight": (E4M3, 1, None), "grad": (E4M3, 1, None)}, True),
    "blockwise": ({"input": (E4M3, 1, 128), "weight": (E4M3, 128, 128), "grad": (E4M3, 1, 128)}, True),
}


def reference(t: torch.Tensor, recipe: str, operand: str) -> tuple[torch.Tensor, torch.Tensor]:
    """t [rows, k] quantised tile by tile as `recipe` says for `operand`, and dequantised: (fp32 values, the
    decode scale of each tile). A tile's scale maps its amax onto the format's largest value, rounded down to a
    power of two where the recipe says so; a partial tile is scaled by its own amax."""
    (dtype, rows, cols), power_of_two = SPEC[recipe][0][operand], SPEC[recipe][1]
    t = t.float()
    rows, cols = rows or max(1, t.shape[0]), cols or max(1, t.shape[1])  # an expert without tokens: no tiles
    values, scales = torch.zeros_like(t), []
    for r in range(0, t.shape[0], rows):
        scales.append([])
        for c in range(0, t.shape[1], cols):
            tile = t[r : r + rows, c : c + cols]
            scale = torch.tensor(FMAX[dtype]) / tile.abs().max().clamp(min=1e-12)
            if power_of_two:
                scale = torch.tensor(2.0 ** (math.frexp(scale.item())[1] - 1))
            fp8 = (tile * scale).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)
            values[r : r + rows, c : c + cols] = fp8.float() * scale.reciprocal()
            scales[-1].append(scale.reciprocal().item())
    return values, torch.tensor(scales)


def reference_matmuls(recipe: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """y = x W^T, dX = grad W and dW = grad^T x of the dequantised operands, each contracted dimension last."""
    def q(t, operand):
        return reference(t, recipe, operand)[0]
    return (q(x, "input") @ q(w, "weight").t(), q(g, "grad") @ q(w.t(), "weight").t(),
            q(g.t(), "grad") @ q(x.t(), "input").t())


class _Sink:
    def __init__(self, main: torch.Tensor) -> None:
        self.main = main

    def deposit(self, param: torch.Tensor, add) -> None:
        add(self.main)


def _operands(tokens: int, out: int, inp: int, seed: int = 0, experts: int | None = None):
    g = torch.Generator().manual_seed(seed)
    w_shape = (out, inp) if experts is None else (experts, out, inp)
    return (torch.randn(tokens, inp, generator=g) * 3, torch.randn(w_shape, generator=g) * 0.05,
            torch.randn(tokens, out, generator=g) * 1e-3)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_dense_matmuls_equal_the_quantise_dequantise_reference(name):
    """A linear's output, input gradient and weight gradient under each recipe (134 tokens, 160 -> 144: partial
    128-tiles on every side) equal the reference to fp32 rounding; the weight gradient is also added into an fp32
    main gradient (two micro batches accumulate) and none of them equals the unquantised product."""
    x, w, g = _operands(134, 144, 160)
    y_ref, dx_ref, dw_ref = reference_matmuls(name, x, w, g)
    recipe = RECIPES[name]()
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm.linear(x1, w1, recipe=recipe)
    y.backward(g)
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, y_ref, **close)
    torch.testing.assert_close(x1.grad, dx_ref, **close)
    torch.testing.assert_close(w1.grad, dw_ref, **close)
    assert not torch.allclose(y, x @ w.t(), **close) and not torch.allclose(w1.grad, g.t() @ x, **close)

    w2, main = w.clone().requires_grad_(), torch.full(w.shape, 0.5)
    set_sink(w2, _Sink(main))
    for _ in range(2):
        gemm.linear(x, w2, recipe=recipe).backward(g)
    assert w2.grad is None
    torch.testing.assert_close(main, 0.5 + 2 * dw_ref, **close)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_matmuls_are_each_experts_dense_matmul(name):
    """Three experts with 5, 0 and 131 tokens: each expert's rows of the output, the input gradient and its
    weight gradient equal the reference of that expert's own matmul (its operands quantised on their own)."""
    x, w, g = _operands(136, 144, 160, seed=1, experts=3)
    sizes = [5, 0, 131]
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm.grouped_linear(x1, w1, torch.tensor(sizes).cumsum(0).to(torch.int32), RECIPES[name]())
    y.backward(g)
    refs = [reference_matmuls(name, xe, w[e], ge) for e, (xe, ge) in enumerate(zip(x.split(sizes), g.split(sizes)))]
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, torch.cat([r[0] for r in refs]), **close)
    torch.testing.assert_close(x1.grad, torch.cat([r[1] for r in refs]), **close)
    torch.testing.assert_close(w1.grad, torch.stack([r[2] for r in refs]), **close)
    assert torch.equal(w1.grad[1], torch.zeros(144, 160))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_scales_are_the_references_bit_for_bit(name):
    """Every operand's FP8 values and decode scales in every matmul equal the reference's exactly; where the
    recipe rounds scales to powers of two, each is one, and each tile's largest value lands in (max / 2, max]."""
    x, w, g = _operands(134, 144, 160, seed=2)
    recipe = RECIPES[name]()
    for t, operand, matmul in ((x, "input", "forward"), (w, "weight", "forward"), (g, "grad", "input_grad"),
                               (w.t(), "weight", "input_grad"), (g.t(), "grad", "weight_grad"),
                               (x.t(), "input", "weight_grad")):
        quantized = recipe.quantize(t, operand, matmul)
        values, scales = reference(t, name, operand)
        assert torch.equal(quantized.scale, scales), (operand, matmul)
        assert torch.equal(quantized.dequantize(), values), (operand, matmul)
        if SPEC[name][1]:
            assert all(math.frexp(s)[0] == 0.5 for s in quantized.scale.flatten().tolist())
            fmax = FMAX[SPEC[name][0][operand][0]]
            largest = quantized.data.float().abs().amax()
            assert fmax / 2 < largest <= fmax


def test_cpu_kernel_equals_the_emulation_and_refuses_blockwise():
    """torch._scaled_mm takes tensorwise (e4m3 and e5m2) and rowwise scales on the CPU and equals the emulation
    (dequantise, fp32 matmul) bit for bit (so a CPU runs the faster emulation, and CUDA's kernel is held to
    it); DeepSeek's 1 x 128 / 128 x 128 scales it refuses on the CPU, which is
    why blockwise runs the emulation (parallel/fp8/recipes.py)."""
    x, w, g = _operands(134, 144, 160, seed=3)
    for name in ("tensorwise", "rowwise"):
        recipe = RECIPES[name]()
        for a, a_is, b, b_is in ((x, "input", w, "weight"), (g, "grad", w.t(), "weight")):
            qa, qb = recipe.quantize(a, a_is, "forward"), recipe.quantize(b, b_is, "forward")
            kernel = kernel_for(qa, qb)
            assert kernel == {"tensorwise": "tensor", "rowwise": "row"}[name], (name, a_is)
            assert torch.equal(kernel_mm(qa, qb, kernel), qa.dequantize() @ qb.dequantize().t()), (name, a_is)
    blockwise = RECIPES["blockwise"]()
    qx, qw = blockwise.quantize(x[:128, :128], "input", "forward"), blockwise.quantize(w[:128, :128], "weight",
                                                                                      "forward")
    with pytest.raises((RuntimeError, ValueError), match="Invalid scaling configuration"):
        torch._scaled_mm(qx.data, qw.data.t(), qx.scale, qw.scale.t(), out_dtype=torch.float32)


TILEABLE = ["--model.family=llama", "--model.num_layers=2", "--model.hidden_size=128",
            "--model.num_attention_heads=2", "--model.num_query_groups=2", "--model.ffn_hidden_size=256",
            "--model.num_experts=4", "--model.moe_topk=2", "--model.moe_ffn_hidden_size=128",
            "--model.moe_first_dense_layers=1", "--model.seq_length=128", "--model.vocab_size=256",
            "--train.micro_batch_size=1", "--train.global_batch_size=2", "--data.mock=true"]


def _problems(*args: str, world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        validate(parse_config([*TILEABLE, *args]), world)
    return str(err.value)


def test_validator_refuses_fp16_and_shapes_blockwise_cannot_tile():
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        for precision in ("bf16", "fp32"):
            validate(parse_config([*TILEABLE, f"--train.fp8_recipe={recipe}", f"--train.precision={precision}"]), 1)
    assert "set train.precision=bf16" in _problems("--train.fp8_recipe=rowwise", "--train.precision=fp16")
    validate(parse_config([*TILEABLE, "--model.hidden_size=96", "--train.fp8_recipe=rowwise"]), 1)  # any width

    widths = _problems("--train.fp8_recipe=blockwise", "--model.ffn_hidden_size=320", "--model.hidden_size=192",
                       "--model.num_attention_heads=3", "--model.num_query_groups=3")
    assert "model.ffn_hidden_size = 320 not a multiple of 128; set model.ffn_hidden_size=384" in widths
    assert "model.hidden_size = 192 not a multiple of 128; set model.hidden_size=256" in widths
    assert "model.num_attention_heads * head dim = 192 not a multiple of 128; make the whole a multiple" in widths
    split = _problems("--train.fp8_recipe=blockwise", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                      world=2)
    assert ("model.num_attention_heads * head dim = 128 split over 2 ranks is 64 per rank, not a multiple of 128; "
            "make the whole a multiple of 256 (e.g. 256)") in split and "ffn_hidden_size" not in split
    assert "each sequence-parallel shard (parallel.tp=2) holds" in split and "set model.seq_length=256" in split
    chunks = _problems("--train.fp8_recipe=blockwise", "--parallel.cp=2", world=2)
    assert "each of the 2 * parallel.cp=2 half-chunks holds" in chunks and "model.seq_length=512" in chunks
    validate(parse_config([*TILEABLE, "--train.fp8_recipe=blockwise", "--parallel.cp=2", "--model.seq_length=512"]), 2)
    assert fp8_line(parse_config(TILEABLE)) is None
    assert "FP8 on: train.fp8_recipe=blockwise" in fp8_line(parse_config([*TILEABLE, "--train.fp8_recipe=blockwise"]))


RUN = [*TILEABLE, "--train.train_iters=4", "--optim.lr=3e-3", "--logging.progress_bar=false",
       "--logging.log_interval=1", "--data.num_workers=0", "--train.device=cpu"]


def test_a_tiny_moe_model_trains_with_each_recipe_and_its_checkpoint_resumes_without_fp8(tmp_path):
    """Four steps of a two-layer model (a dense layer, an MoE layer; every contracted width whole 128-tiles) in
    fp32 and with each recipe: every step's loss within 1% of fp32's (FP8's error is far below the 4 steps'
    progress), and not equal to it (FP8 ran). The blockwise run's checkpoint holds no FP8 tensor and a run
    without FP8 resumes from it at step 5."""
    runs, files = [], {}
    for recipe in ("none", *sorted(RECIPES)):
        files[recipe] = tmp_path / f"{recipe}.jsonl"
        save = [f"--checkpoint.save={tmp_path / 'ckpt'}"] if recipe == "blockwise" else []
        runs.append([*RUN, f"--train.fp8_recipe={recipe}", f"--logging.metrics_file={files[recipe]}", *save])
    runs.append([*RUN, "--train.train_iters=5", f"--checkpoint.save={tmp_path / 'ckpt'}",
                 f"--logging.metrics_file={tmp_path / 'resumed.jsonl'}"])
    run_ranks(1, pretrain_each, runs)
    losses = {recipe: [r["loss"] for r in metrics(path)] for recipe, path in files.items()}
    for recipe in RECIPES:
        assert len(losses[recipe]) == 4 and losses[recipe] == pytest.approx(losses["none"], rel=1e-2), recipe
        assert losses[recipe] != pytest.approx(losses["none"], rel=1e-7, abs=0), recipe
    assert [r["step"] for r in metrics(tmp_path / "resumed.jsonl")] == [5]
    saved = [t for f in (tmp_path / "ckpt").rglob("*.pt") for t in _tensors(torch.load(f, weights_only=True))]
    assert saved and all(t.dtype not in (E4M3, E5M2) for t in saved)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_an_empty_operand_is_one_tile_of_zeros():
    """A rank may hold none of an operand whose scale it agrees with other ranks (an expert no token of its chunk
    chose): it still gives one amax per whole-spanning dimension (zero), the shape the ranks holding the rest
    give, and quantises to an empty tensor."""
    for name, shape in (("tensorwise", (1, 1)), ("rowwise", (160, 1))):
        seen = []
        recipe = RECIPES[name](lambda amax, operand, matmul, whole, seen=seen: seen.append(amax.clone()) or amax)
        quantized = recipe.quantize(torch.zeros(160, 0), "input", "weight_grad")  # x^T of an expert without tokens
        assert quantized.data.shape == (160, 0) and quantized.dequantize().shape == (160, 0)
        assert seen[0].shape == shape and not seen[0].any(), name
