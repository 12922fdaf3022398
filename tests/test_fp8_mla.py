"""Multi-head latent attention under the FP8 recipes: its projections run through the matmul home with the recipe
like every other linear (the down-projections whole on every rank on its own rows, their tokens split over the
sequence ranks: parallel/layers.py DuplicatedLinear's operand splits), so an MLA model's FP8 run (each recipe,
fp32 mode) at tp 2 + SP, cp 2 and pp 2 reproduces the one device's FP8 run within tests/test_fp8_layouts.py's
tolerances; under blockwise the validator checks MLA's per-rank contraction widths (config_mla.py
latent_attention_widths) and names the fields and values that tile."""

from __future__ import annotations

import pytest
from conftest import tiny_config
from distributed import metrics, pretrain_each, run_ranks
from test_fp8_layouts import RUN, _file, _with_metrics

from megalite.config import ConfigError
from megalite.config_validation import validate
from megalite.parallel.fp8 import RECIPES

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


def _args(recipe: str, *extra: str) -> list[str]:
    return [*RUN, *MLA, *SHAPES[recipe], *extra, f"--train.fp8_recipe={recipe}"]


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory) -> dict[str, list[float]]:
    """Every recipe's one-device MLA run on one spawned rank, then each layout of each recipe on one group of
    two: {run name: its step losses}."""
    root = tmp_path_factory.mktemp("fp8_mla")
    references = {f"{recipe} one device": _args(recipe) for recipe in RECIPES}
    layouts = {f"{recipe} {layout}": _args(recipe, *extra)
               for recipe in RECIPES for layout, (extra, _) in LAYOUTS.items()}
    run_ranks(1, pretrain_each, _with_metrics(root, references))
    run_ranks(2, pretrain_each, _with_metrics(root, layouts))
    return {name: [r["loss"] for r in metrics(root / f"{_file(name)}.jsonl")] for name in [*references, *layouts]}


@pytest.mark.parametrize(("recipe", "layout"), [(recipe, layout) for recipe in sorted(RECIPES) for layout in LAYOUTS])
def test_mla_fp8_at_each_layout_reproduces_the_one_device_run(mla_runs, recipe, layout):
    """As test_fp8_layouts' models: pp sums in the one device's order (1e-6); tp's row-parallel layers and the
    down-projections' weight gradients summed over the sequence ranks, and cp's attention, reorder fp32 sums, which
    can move a value across an FP8 rounding boundary: step 1 within 1e-5, step 2 within 2e-4."""
    _, reorders = LAYOUTS[layout]
    reference, losses = mla_runs[f"{recipe} one device"], mla_runs[f"{recipe} {layout}"]
    assert len(reference) == len(losses) == 2
    assert losses[0] == pytest.approx(reference[0], rel=1e-5 if reorders else 1e-6)
    assert losses[1] == pytest.approx(reference[1], rel=2e-4 if reorders else 1e-6)


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
