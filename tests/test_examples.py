"""Every example config loads, validates for the world size it is meant for, and states the planner's
current verdict; the published model sizes come out of the model code built on the meta device."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from released_configs import RELEASED, released_config

from megalite.checkpoint.hf_config_read import model_config_from_hf
from megalite.checkpoint.hf_tokenizer import TOKENIZER_DIR
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.model.gpt import GPTModel
from megalite.planning.parameters import active_parameters, model_parameters, vocabulary_padding
from megalite.planning.plan import make_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PLANNED = sorted(p for p in EXAMPLES.glob("*.yaml") if p.name != "tiny_cpu.yaml")
PLAN_LINE = re.compile(r"^# plan: python tools/plan.py --config (\S+) --world-size (\d+) --gpu (\S+)\n# -> (.+)$", re.M)


# Continued-pretraining examples -> the released model (tests/released_configs.py) whose converted weights they load.
CONTINUED = {"llama_8b_continue": "Llama-3.1-8B", "qwen3_8b_continue": "Qwen3-8B",
             "gpt_oss_20b_continue": "gpt-oss-20b"}


def test_every_size_has_an_example():
    assert {"gpt2_125m", "gpt2_350m", "gpt2_1.3b", "llama_1b", "llama_8b", "llama_70b", "mixtral_8x7b",
            "qwen3_30b_a3b", "deepseek_v3_671b", "moonlight_16b_a3b", *CONTINUED} <= {p.stem for p in PLANNED}


def test_tiny_cpu_example_validates_for_two_processes():
    validate(parse_config(["--config", str(EXAMPLES / "tiny_cpu.yaml")]), 2)


@pytest.mark.parametrize("path", PLANNED, ids=lambda p: p.stem)
def test_example_validates_and_states_the_planner_verdict(path):
    """The `# plan:` comment is a command to run; the `# ->` line under it is what it prints last."""
    found = PLAN_LINE.search(path.read_text())
    assert found, (f"{path.name}: add '# plan: python tools/plan.py --config examples/{path.name} "
                   "--world-size N --gpu GPU' and under it '# -> ' followed by the verdict that command prints last")
    config, world, gpu, verdict = found.groups()
    assert config == f"examples/{path.name}"
    cfg = parse_config(["--config", str(path)])
    validate(cfg, int(world))
    assert make_plan(cfg, int(world), gpu).verdict() == verdict


def build_on_meta(path: Path) -> GPTModel:
    """The one-device model with parameters on the meta device: shapes, no memory, no initialisation."""
    cfg = parse_config(["--config", str(path)])
    cfg.parallel.tp = cfg.parallel.pp = cfg.parallel.vp = 1
    return GPTModel(cfg.model, torch.device("meta"), seed=cfg.train.seed)


# Published sizes: GPT-2 small 124,439,808 (Hugging Face's count, vocabulary 50257 unpadded), Llama-3.2-1B
# 1.24B, Llama-3.1-8B 8.03B, Mixtral-8x7B 46.7B and Qwen3-30B-A3B 30.5B (model cards; Hugging Face's counts
# 46,702,792,704 and 30,532,122,624), Moonlight-16B-A3B's released config (tests/released_configs.py); the rest are the
# planner's own count (DeepSeek-V3's: the released 671,026,404,352 and its MTP depth).
PUBLISHED = {"gpt2_125m": 124_439_808, "llama_1b": 1_235_814_400, "llama_8b": 8_030_261_248,
             "llama_8b_zero3": 8_030_261_248, "llama_8b_128k": 8_030_261_248, "mixtral_8x7b": 46_702_792_704,
             "qwen3_30b_a3b": 30_532_122_624, "moonlight_16b_a3b": RELEASED["Moonlight-16B-A3B"][1]} | {
                 stem: RELEASED[name][1] for stem, name in CONTINUED.items()}
# Parameters one token uses: Mixtral's 12.9B "active" (its two experts of eight, embeddings included); gpt-oss-20b's
# 4.19B (four experts of 32 with their biases; the model card's 3.6B leaves out the embedding table).
ACTIVE = {"mixtral_8x7b": 12_879_925_248, "gpt_oss_20b_continue": 4_187_440_704}


@pytest.mark.parametrize("path", PLANNED, ids=lambda p: p.stem)
def test_model_built_on_meta_has_the_published_size(path):
    model = build_on_meta(path)
    m = model.cfg
    built = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert built == model_parameters(m)
    if path.stem in PUBLISHED:
        # megalite pads the vocabulary to a multiple of 128 (50257 -> 50304 for GPT-2: 36,096 more
        # embedding parameters); the published counts are of the unpadded vocabulary.
        assert built - vocabulary_padding(m) == PUBLISHED[path.stem]
    if path.stem == "gpt2_125m":
        assert built == 124_475_904
    if path.stem in ACTIVE:
        assert active_parameters(m) == ACTIVE[path.stem]
    elif not m.num_experts:
        assert active_parameters(m) == built


@pytest.mark.parametrize("stem", CONTINUED)
def test_a_continued_pretraining_example_holds_the_model_the_converter_writes(stem):
    """Its model section is what `convert_checkpoint.py --from-hf` derives from the released config.json, but for
    seq_length (the context to train at), so `checkpoint.load` of the converted directory resumes. It reads the
    tokenizer the converter keeps there and saves there too, so a relaunched job continues from its latest save
    instead of starting again from the released weights."""
    cfg = parse_config(["--config", str(EXAMPLES / f"{stem}.yaml")])
    converted = model_config_from_hf(released_config(CONTINUED[stem]), CONTINUED[stem])
    assert cfg.model == dataclasses.replace(converted, seq_length=cfg.model.seq_length)
    assert cfg.checkpoint.save == cfg.checkpoint.load
    assert cfg.data.tokenizer_type == "HuggingFaceTokenizer"
    assert Path(cfg.data.tokenizer_model) == Path(cfg.checkpoint.load) / TOKENIZER_DIR
