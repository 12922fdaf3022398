"""Multi-head latent attention under the FP8 recipes: its projections run through the matmul home with the recipe
like every other linear (the down-projections whole on every rank on its own rows, their tokens split over the
sequence ranks: parallel/layers.py DuplicatedLinear's operand splits), so an MLA model's FP8 run (each recipe,
fp32 mode) at tp 2 + SP, cp 2 and pp 2 reproduces the one device's FP8 run within tests/test_fp8_layouts.py's
tolerances; so does a DeepSeek-V3-shaped one (MLA, experts routed as released, an MTP depth) with experts at ep 2,
in fp32 and in bf16 mode; under blockwise the validator checks MLA's per-rank contraction widths (config_mla.py
latent_attention_widths) and names the fields and values that tile."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, metrics, pretrain_each, run_ranks
from test_fp8_layouts import RUN, _file, _part, _with_metrics, recorded_step

from megalite.config import ConfigError
from megalite.config_validation import validate
from megalite.parallel.context import ParallelContext
from megalite.parallel.fp8 import RECIPES
from megalite.parallel.layers import DuplicatedLinear

MLA = ["--model.multi_latent_attention=true", "--model.num_query_groups=null"]
# Under blockwise each rank's share of every contracted width is whole 128-tiles: 4 heads, 2 a rank at tp 2, of
# qk 64 + 64 and v 64; latents of 128; the key/value down-projection's output, 128 + 64, is 1.5 tiles (whole on
# every rank, its last tile padded alike). The other recipes take any widths, and smaller ones (v != nope).
SHAPES = {"blockwise": ["--model.hidden_size=256", "--model.ffn_hidden_size=512", "--model.seq_length=512",
                        "--model.num_attention_heads=4", "--model.q_lora_rank=128", "--model.kv_lora_rank=128",
                        "--model.qk_head_dim=64", "--model.qk_pos_emb_head_dim=64", "--model.v_head_dim=64"],
          "tensorwise": ["--model.hidden_size=128", "--model.ffn_hidden_size=256", "--model.seq_length=128",
                         "--model.num_attention_heads=2", "--model.q_lora_rank=48", "--model.kv_lora_rank=32",
                         "--model.qk_head_dim=16", "--model.qk_pos_emb_head_dim=8", "--model.v_head_dim=24"]}
SHAPES["rowwise"] = SHAPES["tensorwise"]
# layout: (its arguments, whether it changes how fp32 sums are ordered)
LAYOUTS = {"tp2 SP": (["--parallel.tp=2", "--parallel.sequence_parallel=true"], True),
           "cp2": (["--parallel.cp=2"], True),
           "pp2": (["--parallel.pp=2"], False)}


# DeepSeek-V3 in miniature beside MLA: its MoE (sigmoid scores, groups scored by their two best, the expert bias,
# routed_scaling_factor, a shared expert, a dense first layer) and a multi-token prediction depth (an MLA + MoE layer
# whose matmuls take the recipe too); its experts' and shared expert's widths whole 128-tiles under blockwise (the
# shared expert's per tp rank too).
DEEPSEEK_V3 = ["--model.num_experts=4", "--model.moe_topk=2", "--model.moe_first_dense_layers=1",
                "--model.moe_router=sigmoid", "--model.moe_router_groups=2", "--model.moe_router_group_topk=1",
                "--model.moe_router_group_experts=2", "--model.moe_expert_bias=true", "--model.moe_scaling_factor=2.5",
                "--model.moe_norm_topk_prob=true", "--model.mtp_num_layers=1"]
EXPERT_WIDTHS = {"blockwise": ["--model.moe_ffn_hidden_size=128", "--model.moe_shared_expert_size=256"],
                 "tensorwise": ["--model.moe_ffn_hidden_size=64", "--model.moe_shared_expert_size=64"]}
EXPERT_WIDTHS["rowwise"] = EXPERT_WIDTHS["tensorwise"]
# bf16 mode: Megatron-LM's --bf16 (bf16 parameters and autocast, fp32 main weights) around the FP8 matmuls.
PRECISIONS = {"fp32": [], "bf16": ["--train.precision=bf16", "--train.param_dtype=bf16"]}
# The DeepSeek-V3-shaped model's layouts: (precision, layout) -> its arguments. Experts at ep 2 folded over tp (as
# tests/test_fp8_layouts.py's experts: each expert runs on all of a micro batch's tokens, as on one device; ep
# folded over dp would quantise two micro batches' tokens together under tensorwise and rowwise). cp 2 keeps every
# expert on every rank, their tokens split over the cp ranks: not under blockwise (test_fp8_layouts' SPLIT_EXPERTS).
EP2 = ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2"]
DEEPSEEK_LAYOUTS = {("fp32", "tp2 SP x ep2"): EP2, ("bf16", "tp2 SP x ep2"): EP2, ("bf16", "cp2"): ["--parallel.cp=2"]}
DEEPSEEK_CASES = [(recipe, precision, layout) for recipe in sorted(RECIPES) for precision, layout in DEEPSEEK_LAYOUTS
                  if not (recipe == "blockwise" and layout == "cp2")]


# A down-projection alone: 256 tokens of hidden 256 into a 128 + 64 wide latent and rotary key (1.5 tiles)
TOKENS, HIDDEN, DOWN = 256, 256, 192
SPLITS = {"tp2 SP": ({"tp": 2}, True), "cp2": ({"cp": 2}, False)}  # layout: (axis sizes, sequence parallel)


def _down_projection(name: str, ctx: ParallelContext, x: torch.Tensor, weight: torch.Tensor,
                     grad: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
    """One forward and backward of a DuplicatedLinear under recipe `name` at `ctx`'s layout on this rank's rows
    of x and grad: its recorded amaxes and [y, dx, dw]."""
    return recorded_step(DuplicatedLinear(HIDDEN, DOWN, ctx), name, x, weight, grad)


def _operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return (torch.randn(TOKENS, 1, HIDDEN, generator=g) * 3, torch.randn(DOWN, HIDDEN, generator=g) * 0.05,
            torch.randn(TOKENS, 1, DOWN, generator=g) * 1e-3)


def _two_ranks(rank: int, world_size: int, runs: list[list[str]]) -> dict:
    """The down-projection at each of SPLITS under each recipe ({(layout, recipe): (amaxes, results)}), then the
    model runs, in one group of two."""
    layers = {}
    for layout, (sizes, sp) in SPLITS.items():
        ctx = ParallelContext.from_topology(cpu_topology(rank, world_size, **sizes), sp, seed=0)
        x, weight, grad = _operands()
        mine = (x.chunk(2)[rank], weight, grad.chunk(2)[rank])  # either way this rank's half of the tokens
        layers |= {(layout, name): _down_projection(name, ctx, *mine) for name in sorted(RECIPES)}
    pretrain_each(rank, world_size, runs)
    return layers


def _args(recipe: str, *extra: str) -> list[str]:
    return [*RUN, *MLA, *SHAPES[recipe], *extra, f"--train.fp8_recipe={recipe}"]


def _deepseek_args(recipe: str, precision: str, *extra: str, widths: str | None = None) -> list[str]:
    """The DeepSeek-V3-shaped model's run under `recipe` at the shapes of recipe `widths` (default: its own)."""
    widths = widths or recipe
    return [*RUN, *MLA, *SHAPES[widths], *DEEPSEEK_V3, *EXPERT_WIDTHS[widths], *PRECISIONS[precision], *extra,
            f"--train.fp8_recipe={recipe}"]


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory) -> tuple[dict[str, list[float]], list[dict]]:
    """Every recipe's one-device MLA run on one spawned rank, then in one group of two the down-projection alone
    at SPLITS and each layout of each recipe: ({run name: its step losses}, each rank's down-projections)."""
    root = tmp_path_factory.mktemp("fp8_mla")
    references = {f"{recipe} one device": _args(recipe) for recipe in RECIPES}
    references |= {f"deepseek {recipe} {precision} one device": _deepseek_args(recipe, precision)
                   for recipe in RECIPES for precision in PRECISIONS}
    references |= {f"deepseek none bf16 at {widths}'s shapes": _deepseek_args("none", "bf16", widths=widths)
                   for widths in ("tensorwise", "blockwise")}
    layouts = {f"{recipe} {layout}": _args(recipe, *extra)
               for recipe in RECIPES for layout, (extra, _) in LAYOUTS.items()}
    layouts |= {f"deepseek {recipe} {precision} {layout}": _deepseek_args(recipe, precision,
                                                                          *DEEPSEEK_LAYOUTS[precision, layout])
                for recipe, precision, layout in DEEPSEEK_CASES}
    run_ranks(1, pretrain_each, _with_metrics(root, references))
    down_projections = run_ranks(2, _two_ranks, _with_metrics(root, layouts))
    losses = {name: [r["loss"] for r in metrics(root / f"{_file(name)}.jsonl")] for name in [*references, *layouts]}
    losses |= {f"{name} MTP": [r["mtp_1_loss"] for r in metrics(root / f"{_file(name)}.jsonl")]
               for name in [*references, *layouts] if name.startswith("deepseek")}
    return losses, down_projections


@pytest.mark.parametrize("layout", SPLITS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_down_projection_scales_are_the_one_devices(mla_runs, layout, recipe):
    """A down-projection on its rank's half of the tokens (sequence parallel over tp, or context parallel) agrees
    every amax its scales come from with the one device's bit for bit (reduced over the sequence ranks where a
    tile spans the tokens); its outputs and input gradients are the one device's rows, and its weight gradients,
    partial, sum to the one device's."""
    one_device, (y, dx, dw) = _down_projection(recipe, ParallelContext(), *_operands())
    summed = 0
    for rank, layers in enumerate(mla_runs[1]):
        seen, (my_y, my_dx, my_dw) = layers[(layout, recipe)]
        assert [key[:2] for key in seen] == [key[:2] for key in one_device]
        axes = {"forward": ("sequence", None), "input_grad": ("sequence", None), "weight_grad": (None, "sequence")}
        for (operand, matmul, amax), (_, _, reference) in zip(seen, one_device):
            rows_and_k = axes[matmul] if operand != "weight" else (None, None)
            assert torch.equal(amax, _part(reference, amax, rows_and_k, {"sequence": (rank, 2)})), (operand, matmul)
        torch.testing.assert_close(my_y, y.chunk(2)[rank], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(my_dx, dx.chunk(2)[rank], rtol=1e-5, atol=1e-9)
        summed = summed + my_dw
    torch.testing.assert_close(summed, dw, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(("recipe", "layout"), [(recipe, layout) for recipe in sorted(RECIPES) for layout in LAYOUTS])
def test_mla_fp8_at_each_layout_reproduces_the_one_device_run(mla_runs, recipe, layout):
    """As test_fp8_layouts' models: pp sums in the one device's order (1e-6); tp's row-parallel layers and the
    down-projections' weight gradients summed over the sequence ranks, and cp's attention, reorder fp32 sums, which
    can move a value across an FP8 rounding boundary: step 1 within 1e-5, step 2 within 2e-4."""
    _, reorders = LAYOUTS[layout]
    reference, losses = mla_runs[0][f"{recipe} one device"], mla_runs[0][f"{recipe} {layout}"]
    assert len(reference) == len(losses) == 2
    assert losses[0] == pytest.approx(reference[0], rel=1e-5 if reorders else 1e-6)
    assert losses[1] == pytest.approx(reference[1], rel=2e-4 if reorders else 1e-6)


@pytest.mark.parametrize(("recipe", "precision", "layout"), DEEPSEEK_CASES, ids=" ".join)
def test_deepseek_v3_shaped_fp8_with_experts_reproduces_the_one_device_run(mla_runs, recipe, precision, layout):
    """MLA with DeepSeek-V3's experts and an MTP depth under each recipe, at tp 2 + SP x ep 2 and (not blockwise)
    cp 2, the main and the MTP losses: in fp32 mode within test_mla_fp8_at_each_layout's tolerances. In bf16 mode
    the reordered sums (tp's row-parallel layers, the all-to-all's partial expert outputs summed on the token's
    rank, cp's attention merges) are rounded to bf16 where the one device rounds its own once (2^-8 relative on a
    value); two steps moved the losses by up to 2e-4 here: 1e-3 leaves 5x margin, while a token routed to another
    expert, a lost block or an unreduced scale in bf16 changes the computation outright."""
    for series in ("", " MTP"):
        reference = mla_runs[0][f"deepseek {recipe} {precision} one device{series}"]
        losses = mla_runs[0][f"deepseek {recipe} {precision} {layout}{series}"]
        assert len(reference) == len(losses) == 2
        if precision == "fp32":
            assert losses[0] == pytest.approx(reference[0], rel=1e-5), series
            assert losses[1] == pytest.approx(reference[1], rel=2e-4), series
        else:
            assert losses == pytest.approx(reference, rel=1e-3), series


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_deepseek_v3_shaped_fp8_in_bf16_mode_trains_like_bf16(mla_runs, recipe):
    """On one device, each recipe's bf16-mode run of the DeepSeek-V3-shaped model is within 1% of the same run
    without FP8 (FP8's error is far below that), main and MTP losses, and FP8 ran (its losses are not the run
    without it's)."""
    widths = "blockwise" if recipe == "blockwise" else "tensorwise"
    for series in ("", " MTP"):
        reference = mla_runs[0][f"deepseek none bf16 at {widths}'s shapes{series}"]
        losses = mla_runs[0][f"deepseek {recipe} bf16 one device{series}"]
        assert len(losses) == len(reference) == 2
        assert losses != pytest.approx(reference, rel=1e-6, abs=0), series
        assert losses == pytest.approx(reference, rel=1e-2), series


def _blockwise_problems(tp: int, **model) -> list[str]:
    cfg = tiny_config("llama", model={"multi_latent_attention": True, "num_query_groups": None, "seq_length": 512,
                                      "hidden_size": 256, "ffn_hidden_size": 512, **model},
                      train={"fp8_recipe": "blockwise", "precision": "fp32"}, parallel={"tp": tp})
    try:
        validate(cfg, tp)
    except ConfigError as error:
        return [p for p in error.problems if "blockwise" in p]
    return []


def test_blockwise_validates_mla_widths_per_rank_naming_the_fields():
    """DeepSeek-V3's widths tile (its 576-wide key/value down-projection output too: whole on every rank); a
    latent that is not whole tiles is named with a value that is; a head width whose tensor-parallel share is not
    is named with the whole it splits and a multiple that tiles."""
    v3 = {"num_attention_heads": 4, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128,
          "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
    assert _blockwise_problems(2, **v3) == []
    assert _blockwise_problems(1, **{**v3, "q_lora_rank": None}) == []
    (latent,) = _blockwise_problems(1, **{**v3, "kv_lora_rank": 96})
    assert "model.kv_lora_rank = 96 not a multiple of 128; set model.kv_lora_rank=128" in latent
    (query,) = _blockwise_problems(1, **{**v3, "q_lora_rank": 200})
    assert "model.q_lora_rank = 200 not a multiple of 128; set model.q_lora_rank=256" in query
    narrow = _blockwise_problems(2, **{**v3, "num_attention_heads": 2, "qk_head_dim": 64, "v_head_dim": 96})
    assert len(narrow) == 2
    assert ("model.num_attention_heads * (model.qk_head_dim + model.v_head_dim) = 320 split over 2 ranks is 160 "
            "per rank, not a multiple of 128; make the whole a multiple of 256 (e.g. 512)") in narrow[0]
    assert "model.num_attention_heads * model.v_head_dim = 192 split over 2 ranks is 96 per rank" in narrow[1]
    (qk,) = _blockwise_problems(2, **{**v3, "num_attention_heads": 2})
    assert "model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim) = 384 split over 2" in qk
