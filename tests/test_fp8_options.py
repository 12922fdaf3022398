"""Which matmuls run FP8: train.fp8_first_last_layers_bf16 with train.fp8_num_layers_at_start_in_bf16 /
train.fp8_num_layers_at_end_in_bf16 (Megatron-LM's --first-last-layers-bf16 and its counts) keep the first and
last transformer layers of the whole model out of FP8, train.fp8_output_head puts the LM head in: the modules
that hold each recipe, the same layers at pp 2 as on one device (built and trained: equal losses in fp32 mode),
the validator's refusals naming the field, and the log's FP8 line."""

from __future__ import annotations

import pytest
import torch
from distributed import metrics, pretrain_each, run_ranks
from test_fp8_layouts import RUN, SHAPES

from megalite.config import ConfigError
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.parallel.context import ParallelContext
from megalite.parallel.fp8 import Float8
from megalite.parallel.gemm import RecipeSlot
from megalite.training.build import build_model
from megalite.training.run_summary import fp8_line

MODEL = ["--model.family=llama", "--model.num_layers=4", "--model.hidden_size=128", "--model.num_attention_heads=2",
         "--model.num_query_groups=2", "--model.ffn_hidden_size=256", "--model.seq_length=128",
         "--model.vocab_size=256", "--train.micro_batch_size=1", "--train.global_batch_size=2", "--data.mock=true"]
OPTIONS = ["--train.fp8_recipe=tensorwise", "--train.fp8_first_last_layers_bf16=true", "--train.fp8_output_head=true"]


def _recipes(*args: str, pp: int = 1) -> dict[str, str]:
    """{global name of every matmul module on every pipeline stage: the name of its recipe}, built as
    build_model builds each stage (one device's shards)."""
    cfg = parse_config([*MODEL, *args, f"--parallel.pp={pp}"])
    validate(cfg, pp)
    found = {}
    for stage in range(pp):
        model = build_model(cfg, torch.device("meta"), ParallelContext(), stage)
        for name, module in model.named_modules():
            if isinstance(module, RecipeSlot):
                found[name] = module.recipe.name if isinstance(module.recipe, Float8) else "high precision"
    return found


def _in_fp8(recipes: dict[str, str]) -> set[str]:
    return {name for name, recipe in recipes.items() if recipe == "tensorwise"}


def test_first_last_layers_and_the_head_hold_the_recipes_asked_for_at_any_pipeline_layout():
    """Default: every transformer layer's linears in FP8, the head not. With the options (counts 1 and 1, then 2
    and 0) the kept-out layers hold no FP8 matmul, the others every one of theirs, and the head FP8; pp 2 holds
    the same recipe in every module as one device."""
    plain = _recipes("--train.fp8_recipe=tensorwise")
    layer_linears = {name for name in plain if name.startswith("layers.")}
    assert _in_fp8(plain) == layer_linears and plain["lm_head"] == "high precision"
    assert {name.split(".")[1] for name in layer_linears} == {"0", "1", "2", "3"}

    for counts, fp8_layers in (((1, 1), {"1", "2"}), ((2, 0), {"2", "3"})):
        args = [*OPTIONS, f"--train.fp8_num_layers_at_start_in_bf16={counts[0]}",
                f"--train.fp8_num_layers_at_end_in_bf16={counts[1]}"]
        one_device = _recipes(*args)
        expected = {name for name in layer_linears if name.split(".")[1] in fp8_layers} | {"lm_head"}
        assert _in_fp8(one_device) == expected, counts
        assert _recipes(*args, pp=2) == one_device, counts


def _problems(*args: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(parse_config([*MODEL, *args]), 1)
    return str(err.value)


def test_the_options_are_validated_naming_the_field():
    assert "train.fp8_first_last_layers_bf16=true changes which matmuls run in FP8, but train.fp8_recipe=none" in (
        _problems("--train.fp8_first_last_layers_bf16=true"))
    assert "train.fp8_output_head=true changes" in _problems("--train.fp8_output_head=true")
    assert ("train.fp8_num_layers_at_end_in_bf16=2 is read only with train.fp8_first_last_layers_bf16=true"
            in _problems("--train.fp8_recipe=rowwise", "--train.fp8_num_layers_at_end_in_bf16=2"))
    assert "train.fp8_num_layers_at_start_in_bf16=-1 must be >= 0" in _problems(
        "--train.fp8_recipe=rowwise", "--train.fp8_first_last_layers_bf16=true",
        "--train.fp8_num_layers_at_start_in_bf16=-1")
    every = _problems("--train.fp8_recipe=rowwise", "--train.fp8_first_last_layers_bf16=true",
                      "--train.fp8_num_layers_at_start_in_bf16=2", "--train.fp8_num_layers_at_end_in_bf16=2")
    assert ("= 4 keeps every one of model.num_layers=4 out of FP8, and the head too (train.fp8_output_head=false): "
            "nothing would run in FP8; lower them (together at most 3)") in every
    # with the head in FP8 every layer may stay out; more layers than the model has may not
    validate(parse_config([*MODEL, *OPTIONS, "--train.fp8_num_layers_at_start_in_bf16=4",
                           "--train.fp8_num_layers_at_end_in_bf16=0"]), 1)
    assert "= 6 asks for more layers than model.num_layers=4; lower them (together at most 4)" in _problems(
        *OPTIONS, "--train.fp8_num_layers_at_start_in_bf16=5")
    head = _problems("--train.fp8_recipe=blockwise", "--train.fp8_output_head=true", "--model.vocab_size=320",
                     "--model.make_vocab_size_divisible_by=64")
    assert ("the LM head's padded vocabulary 320 over parallel.tp=1 is 320 rows per rank, not a multiple of 128; "
            "set model.make_vocab_size_divisible_by=128") in head


def test_the_fp8_line_says_which_layers_and_the_head():
    assert "in the linears and experts of every transformer layer;" in fp8_line(parse_config(
        [*MODEL, "--train.fp8_recipe=tensorwise"]))
    line = fp8_line(parse_config([*MODEL, *OPTIONS, "--train.precision=bf16"]))
    assert ("of transformer layers 1-2 of 0-3 (layers 0, 3 in bf16: train.fp8_first_last_layers_bf16); the LM head "
            "in FP8 too (train.fp8_output_head); embeddings and the routers in bf16") in line


def test_first_last_layers_and_head_at_pp2_reproduce_the_one_device_run(tmp_path):
    """Four layers, the first and last out of FP8 (layer 1 in FP8 on stage 0, layer 2 on stage 1) and the head in
    FP8, in fp32 mode: pp 2's losses equal one device's to 1e-6 (pipeline stages sum in the one device's order);
    tp 2 with SP (the vocabulary-parallel head's scale agreed over tp) within test_fp8_layouts' bounds for layouts
    that reorder sums; both differ from every layer in FP8 with the head not (the options ran)."""
    args = [*RUN, *SHAPES["tensorwise"], "--model.num_layers=4"]
    runs = {"one device": [*args, *OPTIONS], "plain": [*args, "--train.fp8_recipe=tensorwise"],
            "pp2": [*args, *OPTIONS, "--parallel.pp=2"],
            "tp2 SP": [*args, *OPTIONS, "--parallel.tp=2", "--parallel.sequence_parallel=true"]}
    files = {name: tmp_path / f"{name.replace(' ', '_')}.jsonl" for name in runs}
    logged = {name: [*run, f"--logging.metrics_file={files[name]}"] for name, run in runs.items()}
    run_ranks(1, pretrain_each, [logged["one device"], logged["plain"]])
    run_ranks(2, pretrain_each, [logged["pp2"], logged["tp2 SP"]])
    losses = {name: [r["loss"] for r in metrics(path)] for name, path in files.items()}
    reference = losses["one device"]
    assert len(reference) == 2 and losses["plain"] != pytest.approx(reference, rel=1e-6)
    assert losses["pp2"] == pytest.approx(reference, rel=1e-6)
    assert losses["tp2 SP"][0] == pytest.approx(reference[0], rel=1e-5)
    assert losses["tp2 SP"][1] == pytest.approx(reference[1], rel=2e-4)
