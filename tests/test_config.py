"""Config: YAML loading, command-line overrides, validation messages, --help."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from megalite.config import FAMILY_FEATURES, SECTIONS, Config, ConfigError, Features
from megalite.config_cli import config_from_yaml_text, dump_yaml, help_text, parse_config
from megalite.config_validation import validate
from megalite.model.gpt import GPTModel
from megalite.training.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_then_overrides_in_both_syntaxes(tmp_path):
    path = _yaml(tmp_path, "model:\n  num_layers: 6\n  family: llama\ntrain:\n  precision: bf16\n")
    cfg = parse_config(["--config", path, "--model.num_layers=8", "--optim.lr", "1e-3",
                        "--parallel.sequence_parallel=true", "--model.num_query_groups=none"])
    assert cfg.model.num_layers == 8 and cfg.model.family == "llama" and cfg.train.precision == "bf16"
    assert cfg.optim.lr == 1e-3 and cfg.parallel.sequence_parallel is True and cfg.model.num_query_groups is None


def test_unknown_field_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match=r"model.num_layer.*did you mean 'num_layers'"):
        parse_config(["--model.num_layer=3"])
    with pytest.raises(ConfigError, match=r"run.yaml.*unknown section 'trian'.*did you mean 'train'"):
        parse_config(["--config", _yaml(tmp_path, "trian:\n  seed: 1\n")])


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--train.micro_batch_size=two", "expected int, got 'two'"),
        ("--train.micro_batch_size=2.5", "expected int"),
        ("--train.precision=fp8", "not one of fp32, bf16, fp16"),
        ("--parallel.sequence_parallel=maybe", "expected true or false"),
        ("--train.seed", "needs a value"),
        ("stray", "unexpected argument"),
    ],
)
def test_bad_values_name_the_field(arg, message):
    with pytest.raises(ConfigError, match=message):
        parse_config([arg])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config(["--config", _yaml(tmp_path, "model: [\n")])


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({"model.hidden_size": 130, "model.num_attention_heads": 4}, 1,
         "hidden_size=130 is not divisible by model.num_attention_heads=4"),
        ({"model.num_query_groups": 3}, 1, "num_attention_heads=4 is not divisible by model.num_query_groups=3"),
        ({"parallel.tp": 2}, 3, "world size 3 is not divisible by parallel.tp\\*parallel.pp=2"),
        ({"train.micro_batch_size": 2, "train.global_batch_size": 6}, 2,
         "global_batch_size=6 is not divisible by train.micro_batch_size\\*dp=2\\*2=4"),
        ({"model.make_vocab_size_divisible_by": 100, "parallel.tp": 8}, 8,
         "make_vocab_size_divisible_by=100 must be divisible by parallel.tp=8"),
        ({"optim.min_lr": 1.0}, 1, "min_lr <= optim.lr"),
        ({"checkpoint.save_interval": 5}, 1, "checkpoint.save is not"),
        ({"model.seq_length": 256, "model.max_position_embeddings": 128}, 1,
         "max_position_embeddings=128 < model.seq_length=256"),
        ({"parallel.cp": 2, "parallel.tp": 2}, 6, "world size 6 is not divisible by "
         "parallel.tp\\*parallel.cp\\*parallel.pp=4; launch a multiple of tp\\*cp\\*pp processes"),
        ({"parallel.cp": 4, "model.seq_length": 36}, 4,
         "model.seq_length=36 is not divisible by 8 = 2 \\* parallel.cp"),
        ({"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true", "model.seq_length": 36}, 4,
         "seq_length=36 is not divisible by 8 = 2 \\* parallel.cp \\* parallel.tp \\(sequence parallelism\\)"),
        ({"parallel.cp": 2, "model.attention_dropout": 0.1}, 2, "context-parallel attention has no dropout"),
        ({"model.head_dim": 0}, 1, "model.head_dim=0 must be >= 1, or unset"),
        ({"model.family": "llama", "model.head_dim": 15}, 1,
         r"needs an even head dim, got model.head_dim=15; change the width, the head count or model.head_dim"),
        ({"model.rope_scaling": "llama3"}, 1,
         "model.rope_scaling=llama3 scales RoPE, but model.position_embedding=learned; set"),
        ({"model.family": "llama", "model.rope_scaling": "llama3", "model.rope_scaling_factor": 0.5}, 1,
         "model.rope_scaling_factor=0.5 must be >= 1"),
        ({"model.family": "llama", "model.rope_scaling": "llama3", "model.rope_low_freq_factor": 4}, 1,
         "need 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got 4.0 and 4.0"),
        ({"model.family": "llama", "model.rope_scaling": "llama3", "model.rope_original_max_positions": 0}, 1,
         "model.rope_original_max_positions=0 must be >= 1"),
        ({"model.family": "llama", "model.rope_scaling": "yarn", "model.rope_beta_slow": 40}, 1,
         r"need 0 < model.rope_beta_slow <= model.rope_beta_fast, got 40.0 and 32.0 \(YaRN: 1 and 32; Kimi K2"),
        ({"model.sliding_window": 0}, 1, "model.sliding_window=0 must be >= 1 .* or unset for full causal attention"),
        ({"model.sliding_window": 4, "model.sliding_window_layers": "[0, 2]"}, 1,
         r"model.sliding_window_layers has \[2\], but layers are numbered 0..1"),
        ({"model.sliding_window_layers": "[0]"}, 1, "model.sliding_window_layers is set without model.sliding_window"),
        ({"model.sliding_window": 4, "model.attention_dropout": 0.1}, 1,
         "model.attention_dropout=0.1 with a sliding window or attention sinks: their attention kernels have no "
         "dropout"),
        ({"model.attention_sinks": "true", "model.attention_dropout": 0.1}, 1, "with a sliding window or attention "
                                                                                "sinks"),
        ({"model.glu_limit": 7.0}, 1, "model.glu_limit=7.0 clamps a gated MLP's gate .* with model.gated_mlp=true"),
    ],
)
def test_validation_says_what_and_how(overrides, world, message):
    cfg = parse_config([f"--{k}={v}" for k, v in overrides.items()]
                       + ["--model.num_attention_heads=4", "--data.mock=true"])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world)


def test_validation_reports_every_problem_at_once():
    cfg = parse_config(["--model.hidden_size=130", "--optim.warmup_iters=1000", "--train.train_iters=10",
                        "--data.mock=true"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert "hidden_size" in str(err.value) and "warmup_iters" in str(err.value)


def test_defaults_are_valid_and_dp_is_derived():
    cfg = Config()
    cfg.data.mock = True
    validate(cfg, 4)
    assert cfg.data_parallel_size(4) == 4 and cfg.batch_size(4) == 4 and cfg.num_microbatches(4) == 1


def test_list_fields_from_yaml_and_command_line(tmp_path):
    path = _yaml(tmp_path, "data:\n  paths: [0.7, /d/a, 0.3, /d/b]\n")
    assert parse_config(["--config", path]).data.paths == ["0.7", "/d/a", "0.3", "/d/b"]
    assert parse_config(["--data.paths=0.5 /d/a 0.5 /d/b"]).data.paths == ["0.5", "/d/a", "0.5", "/d/b"]
    assert parse_config(["--data.paths", "[/d/a]"]).data.paths == ["/d/a"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no training data: give --data.paths"),
        (["--data.mock=true", "--data.paths=/d/a"], "choose one"),
        (["--data.paths=/d/a"], "data.tokenizer_type is required"),
    ],
)
def test_data_source_is_required_and_unambiguous(args, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_config(args), 1)


CORPUS_YAML = "data:\n  train_paths: [/d/a]\n  valid_paths: [/d/b]\n  tokenizer_type: GPT2BPETokenizer\n"


def test_command_line_mock_drops_the_yaml_corpus_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    path = _yaml(tmp_path, CORPUS_YAML)
    cfg = parse_config(["--config", path, "--data.mock=true"])
    validate(cfg, 1)
    assert cfg.data.mock and cfg.data.train_paths is None and cfg.data.valid_paths is None
    assert capsys.readouterr().out == f"--data.mock=true: ignoring data.train_paths, data.valid_paths from {path}\n"
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 says it
    parse_config(["--config", path, "--data.mock=true"])
    assert capsys.readouterr().out == ""


def test_command_line_corpus_drops_the_yaml_mock(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    path = _yaml(tmp_path, "data:\n  mock: true\n  tokenizer_type: NullTokenizer\n")
    cfg = parse_config(["--config", path, "--data.paths=/d/a"])
    validate(cfg, 1)
    assert not cfg.data.mock and cfg.data.paths == ["/d/a"]
    assert capsys.readouterr().out == f"--data.paths given: ignoring data.mock=true from {path}\n"


@pytest.mark.parametrize("where", ["yaml", "command line"])
def test_mock_and_corpus_on_one_level_name_the_flag_to_add(tmp_path, where):
    if where == "yaml":
        args = ["--config", _yaml(tmp_path, CORPUS_YAML + "  mock: true\n")]
    else:
        args = ["--data.mock=true", "--data.train_paths=/d/a", "--data.valid_paths=/d/b",
                "--data.tokenizer_type=NullTokenizer"]
    with pytest.raises(ConfigError) as error:
        validate(parse_config(args), 1)
    assert ("data.mock=true and data.train_paths, data.valid_paths are both set; choose one: --data.train_paths=null "
            "--data.valid_paths=null for synthetic tokens, or --data.mock=false for the corpus") in str(error.value)


def test_yaml_dump_round_trips():
    cfg = parse_config(["--model.family=llama", "--model.num_query_groups=2", "--optim.decay_style=wsd"])
    assert config_from_yaml_text(dump_yaml(cfg), "test") == cfg


def test_model_features_come_from_the_family_unless_set():
    cfg = parse_config(["--model.family=llama", "--model.bias=true", "--model.norm=none"])
    assert cfg.model.features == Features(bias=True, gated_mlp=True, norm="rmsnorm", position_embedding="rope",
                                          tie_embeddings=False)
    assert config_from_yaml_text(dump_yaml(cfg), "test") == cfg
    cfg.model.bias = None
    cfg.model.family = "gpt2"  # tools change the family of a built config: the defaults follow
    assert cfg.model.features == FAMILY_FEATURES["gpt2"] and cfg.model.tied
    assert cfg.model.ffn_size == 4 * cfg.model.hidden_size
    cfg.model.gated_mlp = True
    assert cfg.model.ffn_size == 64 * 6  # 8/3 * 128 rounded up to 64
    with pytest.raises(ConfigError, match="model.norm: 'LayerNorm' is not one of layernorm, rmsnorm"):
        parse_config(["--model.norm=LayerNorm"])


def test_activation_comes_from_the_family_unless_set():
    """model.activation: the field Megatron-LM checkpoints set to gelu (its GPT's exact GELU)."""
    assert parse_config(["--model.family=gpt2"]).model.features.activation == "gelu_tanh"
    assert parse_config(["--model.family=llama"]).model.features.activation == "silu"
    assert parse_config(["--model.family=gpt2", "--model.activation=gelu"]).model.features.activation == "gelu"
    with pytest.raises(ConfigError, match="model.activation: 'relu' is not one of gelu_tanh, gelu, silu"):
        parse_config(["--model.activation=relu"])


def test_odd_head_dim_is_refused_for_rope_only():
    odd = {"hidden_size": 60, "num_attention_heads": 4, "num_query_groups": None}  # head dim 15
    with pytest.raises(ConfigError, match=r"model.position_embedding=rope\) needs an even head dim"):
        validate(tiny_config("gpt2", model={**odd, "position_embedding": "rope"}), 1)
    validate(tiny_config("llama", model={**odd, "position_embedding": "learned"}), 1)


def test_head_dim_sets_the_head_width_whatever_the_model_width():
    """Qwen3-0.6B's shape in small: 4 heads 32 wide on a 64-wide model (q 128 wide); any width then works."""
    cfg = tiny_config("qwen3", model={"head_dim": 32, "num_query_groups": 2})
    validate(cfg, 1)
    shapes = _parameter_shapes("qwen3", head_dim=32, num_query_groups=2)
    assert shapes["layers.0.attention.linear_qkv.weight"] == ((4 + 2 * 2) * 32, 64)
    assert shapes["layers.0.attention.linear_proj.weight"] == (64, 4 * 32)
    assert shapes["layers.0.attention.q_norm.weight"] == (32,)
    validate(tiny_config("llama", model={"hidden_size": 66, "head_dim": 16}), 1)  # 66 is no multiple of 4 heads


def _parameter_shapes(family: str, **features) -> dict[str, tuple[int, ...]]:
    cfg = tiny_config(family, model=features)
    return {n: tuple(p.shape) for n, p in GPTModel(cfg.model, torch.device("meta"), seed=0).named_parameters()}


LINEAR_BIASES = {f"layers.{i}.{linear}.bias" for i in range(2)
                 for linear in ("attention.linear_qkv", "attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
NORM_BIASES = {f"layers.{i}.{norm}.bias" for i in range(2) for norm in ("input_norm", "pre_mlp_norm")}
NORM_BIASES |= {"final_norm.bias"}
POSITIONS = {"embedding.position_embeddings.weight"}
QK_NORMS = {f"layers.{i}.attention.{p}_norm.weight" for i in range(2) for p in "qk"}
QKV_BIASES = {f"layers.{i}.attention.linear_qkv.bias" for i in range(2)}


@pytest.mark.parametrize("family, feature, value, added, removed", [
    ("llama", "bias", True, LINEAR_BIASES, set()),
    ("gpt2", "bias", False, set(), LINEAR_BIASES),
    ("llama", "position_embedding", "learned", POSITIONS, set()),
    ("gpt2", "position_embedding", "rope", set(), POSITIONS),
    ("llama", "norm", "layernorm", NORM_BIASES, set()),
    ("gpt2", "norm", "rmsnorm", set(), NORM_BIASES),
    ("llama", "tie_embeddings", True, set(), {"lm_head.weight"}),
    ("gpt2", "tie_embeddings", False, {"lm_head.weight"}, set()),
    ("llama", "qk_norm", True, QK_NORMS, set()),
    ("qwen3", "qk_norm", False, set(), QK_NORMS),
    ("llama", "qkv_bias", True, QKV_BIASES, set()),
    ("qwen2", "qkv_bias", False, set(), QKV_BIASES),
])
def test_a_feature_override_adds_or_removes_exactly_its_parameters(family, feature, value, added, removed):
    base, changed = _parameter_shapes(family), _parameter_shapes(family, **{feature: value})
    assert set(changed) - set(base) == added and set(base) - set(changed) == removed


@pytest.mark.parametrize("family, gated, ffn", [("gpt2", True, 192), ("llama", False, 4 * 64)])
def test_gated_mlp_override_sets_the_mlp_shapes(family, gated, ffn):
    shapes = _parameter_shapes(family, gated_mlp=gated)
    assert shapes["layers.0.mlp.linear_fc1.weight"] == ((2 if gated else 1) * ffn, 64)
    assert shapes["layers.0.mlp.linear_fc2.weight"] == (64, ffn)


def test_a_llama_with_biases_and_learned_positions_trains():
    cfg = tiny_config("llama", model={"bias": True, "position_embedding": "learned"}, train={"train_iters": 2})
    losses = list(pretrain(cfg).losses.values())
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_help_lists_every_field_with_default_and_doc():
    text = help_text()
    for section, cls in SECTIONS.items():
        for field in cls.__dataclass_fields__.values():
            line = next(l for l in text.splitlines() if l.strip().startswith(f"--{section}.{field.name} "))
            assert f"(default: {field.default})" in line and field.metadata["doc"] in line


def test_entry_point_help_and_config_errors():
    run = lambda *args: subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *args], capture_output=True,
                                       text=True, cwd=ROOT)
    shown = run("--help")
    assert shown.returncode == 0 and "--parallel.distributed_optimizer" in shown.stdout
    failed = run("--model.hidden_size=130", "--model.num_attention_heads=4", "--data.mock=true")
    assert (failed.returncode == 2 and "hidden_size=130 is not divisible" in failed.stderr
            and "Traceback" not in failed.stderr)


def test_context_parallel_on_too_few_processes_names_the_field():
    """cp was left out of two divisibility checks, so one process with cp = 2 divided by zero (issue 25)."""
    with pytest.raises(ConfigError, match=r"world size 1 is not divisible by parallel.tp\*parallel.cp\*parallel.pp"):
        validate(parse_config(["--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--parallel.cp=2",
                               "--data.mock=true", "--data.paths=null"]), 1)


def test_missing_corpus_files_are_reported_with_the_config(tmp_path):
    """A data prefix whose .bin/.idx are not there is one more config error, found before any process group
    forms; a blend that does not parse names its field. Planning skips the check (the corpus is elsewhere)."""
    args = [f"--data.paths=[0.7, {tmp_path}/web, 0.3, {tmp_path}/books]", "--data.tokenizer_type=NullTokenizer"]
    (tmp_path / "web.bin").write_bytes(b"")
    (tmp_path / "web.idx").write_bytes(b"")
    with pytest.raises(ConfigError) as error:
        validate(parse_config(args), 1, data_files=True)
    assert f"data.paths: {tmp_path}/books.bin and {tmp_path}/books.idx not found" in str(error.value)
    assert "web" not in str(error.value)
    validate(parse_config(args), 1)
    with pytest.raises(ConfigError, match="data.train_paths: blend"):
        validate(parse_config(["--data.train_paths=[0.5, a, b]", "--data.tokenizer_type=NullTokenizer"]), 1,
                 data_files=True)
    failed = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *args], capture_output=True, text=True,
                            cwd=ROOT)
    assert failed.returncode == 2 and "books.idx not found" in failed.stderr and "Traceback" not in failed.stderr
