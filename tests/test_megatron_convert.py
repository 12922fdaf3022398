"""tools/convert_checkpoint.py --from-megatron against checkpoints Megatron-LM's own training code wrote.

The fixtures (tests/fixtures/megatron/*.tar.xz, written by make_fixtures.py with megatron-core 0.19.2) are
a GPT (learned positions, LayerNorm, biases, tied embeddings, padded vocabulary; GELU through Megatron's
default bias-GELU fusion, its tanh form, in the legacy fixture, exact GELU without the fusion in the
torch_dist one), a Llama-style model (RoPE, RMSNorm, SwiGLU, GQA, no biases) and a Qwen-style one (Llama's with
kv_channels 8 = head_dim, not hidden / heads, q/k/v-only biases, per-head RMSNorm q/k norms, and Llama 3.1's
RoPE scaling), each trained 3 steps at tensor parallel 2 x pipeline parallel 2 and saved in the legacy format
(GPT with Megatron's Adam, Llama and Qwen with its distributed optimizer) and in torch_dist (GPT and Qwen with
per-parameter Adam state, Llama with the distributed optimizer's fully reshardable state). Beside each,
Megatron's forward gave the logits of fixed tokens, and one more Megatron training step on a fixed batch gave
its loss and the logits after it: megalite must compute the same at other layouts. The Qwen fixtures' args
name a blend on Megatron's cluster, which the converted config carries over. The mixture-of-experts and
multi-latent-attention fixtures (make_fixtures.py says how each is laid out) join the logits, flat-state and
next-step tests; test_megatron_mla.py tests what is particular to MLA and multi-token prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from distributed import cpu_topology, metrics, pretrain_torchrun, run_ranks

from megalite.checkpoint.local import load_checkpoint
from megalite.checkpoint.megatron.args import activation, check_args
from megalite.checkpoint.megatron.buffer_layout import Param, bucket_slots, coalesced
from megalite.checkpoint.megatron.formats import read_megatron
from megalite.checkpoint.megatron.names import BUFFER
from megalite.checkpoint.megatron.safe_pickle import load_dcp_metadata, load_megatron_pickle
from megalite.checkpoint.megatron.state import MAIN
from megalite.config import DataConfig
from megalite.config_cli import config_from_yaml_text
from megalite.data.batches import Batch
from megalite.inference.generate import load_model
from megalite.model.gpt import GPTModel
from megalite.training.build import build_trainer
from megalite.training.lr_schedule import learning_rate
from megalite.training.step import train_step

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/megatron"
NAMES = ["gpt_torch", "gpt_torch_dist", "llama_torch", "llama_torch_dist", "qwen_torch", "qwen_torch_dist",
         "llama_dp1_torch_dist", "gpt_vp_dp2_torch_dist", "moe_vp_torch", "moe_torch_dist", "mla_torch",
         "mla_pp2_torch", "mla_moe_torch_dist"]
DENSE = NAMES[:6]  # tp 2 x pp 2, 2 samples a step
CLUSTER = "/lustre/megatron/data"  # where the Qwen fixtures' args say their corpora lie
# The data section each fixture's args give (the others keep DataConfig's defaults); the Llama and GPT fixtures'
# args name no data, and every fixture's NullTokenizer is Megatron-Core's (ids below vocab_size), not carried.
DATA = {"qwen_torch": {"paths": ["0.7", f"{CLUSTER}/a_text_document", "0.3", f"{CLUSTER}/b_text_document"],
                       "split": "98,2,0", "cache_dir": f"{CLUSTER}/cache"},
        "qwen_torch_dist": {"train_paths": ["0.6", f"{CLUSTER}/a_text_document", "0.4", f"{CLUSTER}/b_text_document"],
                            "valid_paths": [f"{CLUSTER}/b_text_document"]}}


def convert(*argv: str) -> None:
    """tools/convert_checkpoint.py's main, in this process."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools/convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(list(argv))


def unpack(names: list[str], tmp_path_factory) -> dict[str, Path]:
    """name -> the unpacked Megatron-LM checkpoint directory."""
    root = tmp_path_factory.mktemp("megatron")
    for name in names:
        with tarfile.open(FIXTURES / f"{name}.tar.xz") as tar:
            tar.extractall(root, filter="data")
    return {name: root / name for name in names}


def convert_each(megatron: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """name -> the megalite checkpoint converted from it."""
    out = {}
    for name, directory in megatron.items():
        out[name] = tmp_path_factory.mktemp("converted") / name
        convert("--from-megatron", "--load", str(directory), "--save", str(out[name]))
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    return unpack(NAMES, tmp_path_factory)


@pytest.fixture(scope="module")
def converted(megatron, tmp_path_factory):
    return convert_each(megatron, tmp_path_factory)


def expected(megatron, name: str) -> dict[str, torch.Tensor]:
    return torch.load(megatron[name] / "expected.pt", weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_one_device_logits_equal_megatrons(name, megatron, converted):
    """tp 2 x pp 2 in Megatron, one device in megalite: the logits Megatron's own forward computed."""
    want = expected(megatron, name)
    model, cfg, _ = load_model(converted[name], torch.device("cpu"))
    with torch.no_grad():
        logits = model(want["tokens"])
    torch.testing.assert_close(logits[..., : want["logits"].shape[-1]], want["logits"], atol=2e-6, rtol=0)


def test_megatrons_rope_scaling_is_computed(megatron, converted):
    """The Qwen fixture's logits need Llama 3.1's RoPE scaling (Megatron's factor 8 with its fixed constants):
    without it they are 50 times the tolerance away from Megatron's."""
    want = expected(megatron, "qwen_torch")
    model, cfg, _ = load_model(converted["qwen_torch"], torch.device("cpu"))
    unscaled = GPTModel(dataclasses.replace(cfg.model, rope_scaling="none"), torch.device("cpu"), seed=0)
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        apart = (unscaled(want["tokens"])[..., :64] - want["logits"]).abs().max()
    assert apart > 1e-4


def test_q_k_layernorm_is_refused_where_megatrons_is_a_layernorm(megatron):
    """Megatron's q/k norms take the model's normalization; megalite's are RMSNorm, so a LayerNorm model's are
    refused, as is what megalite does not compute, each with its reason."""
    rank_file = megatron["gpt_torch"] / "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
    args = load_megatron_pickle(rank_file, str(rank_file))["args"]
    with pytest.raises(ValueError, match="args.qk_layernorm=True with args.normalization='LayerNorm'"):
        check_args(argparse.Namespace(**vars(args) | {"qk_layernorm": True}), "ckpt")
    with pytest.raises(ValueError, match=r"args.qk_l2_norm=True \(megalite's q/k norm is RMSNorm, not an L2 norm\), "
                                         r"args.rotary_seq_len_interpolation_factor=4 \(megalite does not interpolate"):
        check_args(argparse.Namespace(**vars(args) | {"qk_l2_norm": True, "rotary_seq_len_interpolation_factor": 4}),
                   "ckpt")


@pytest.mark.parametrize("name", DENSE)
def test_config_and_state_come_from_megatrons_args(name, megatron, converted):
    iteration = converted[name] / "iter_0000003"
    cfg = config_from_yaml_text((iteration / "config.yaml").read_text(), "config.yaml")
    state = json.loads((iteration / "state.json").read_text())
    assert (state["step"], state["consumed_samples"]) == (3, 6)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 16, 4, 8)
    if name.startswith("gpt"):  # gpt_torch kept Megatron's default bias-GELU fusion (tanh), gpt_torch_dist not
        gelu = "gelu_tanh" if name == "gpt_torch" else "gelu"
        assert (m.vocab_size, m.padded_vocab_size, m.tied, m.activation) == (60, 64, True, gelu)
        assert m.features.bias and m.features.norm == "layernorm" and m.features.position_embedding == "learned"
    else:
        assert (m.vocab_size, m.kv_heads, m.ffn_size, m.tied, m.activation) == (64, 2, 24, False, "silu")
        assert m.features.gated_mlp and m.features.norm == "rmsnorm" and m.features.position_embedding == "rope"
    f = m.features
    qwen = (m.head_dim, f.qk_norm, f.qkv_bias, f.bias, m.rope_scaling, m.rope_scaling_factor, m.rope_theta)
    if name.startswith("qwen"):  # --kv-channels 8, --qk-layernorm, --add-qkv-bias, --use-rope-scaling
        assert qwen == (8, True, True, False, "llama3", 8.0, 500000.0)
        assert (m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_positions) == (1.0, 4.0, 8192)
    else:
        assert (m.head_dim, f.qk_norm, m.rope_scaling) == (None, False, "none")
    assert (cfg.optim.lr, cfg.optim.adam_beta2, cfg.optim.weight_decay, cfg.optim.decay_style) == (
        1e-3, 0.95, 0.1, "constant")
    fields = ("paths", "split", "train_paths", "valid_paths", "cache_dir", "tokenizer_type", "blend_rule")
    defaults = DataConfig()
    assert {k: getattr(cfg.data, k) for k in fields} == {k: getattr(defaults, k) for k in fields} | {
        "blend_rule": "megatron"} | DATA.get(name, {})
    assert (cfg.train.seed, cfg.train.train_iters, cfg.train.global_batch_size) == (1234, 100, 2)


def _next_step(rank: int, world_size: int, checkpoint: Path, parallel: dict, batch: dict,
               probe: torch.Tensor, vocab: int) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """Resume `checkpoint` at layout `parallel` (Adam's state included), take one step on `batch` (this rank's
    share of its samples, in Megatron's micro batches where the share holds them: a mixture of experts'
    balancing loss is one per micro batch), and return the step's loss, the logits of `probe` after it and the
    routers' expert biases after it."""
    found = checkpoint / "iter_0000003"
    cfg = config_from_yaml_text((found / "config.yaml").read_text(), "config.yaml")
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vp, cfg.parallel.distributed_optimizer = 1, 1, 1, False
    cfg.parallel.ep = cfg.parallel.etp = 1
    for field, value in parallel.items():
        setattr(cfg.parallel, field, value)
    cfg.model.vocab_size = vocab
    dp = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    share = batch["tokens"].shape[0] // dp
    mine = slice(rank % dp * share, (rank % dp + 1) * share)
    cfg.train.micro_batch_size = min(cfg.train.micro_batch_size, share)
    topology = cpu_topology(rank, world_size, cfg)
    with build_trainer(cfg, topology) as trainer:
        state, _, loaded_optimizer, _ = load_checkpoint(found, trainer.sharded_state(), topology)
        assert loaded_optimizer
        trainer.optimizer.gather_params()
        trainer.optimizer.set_lr(learning_rate(state.step + 1, cfg.optim, cfg.train.train_iters))
        tokens, labels = batch["tokens"][mine], batch["labels"][mine]
        micro = cfg.train.micro_batch_size
        loss = train_step(trainer, [Batch(t, y, torch.ones_like(y, dtype=torch.float32))
                                    for t, y in zip(tokens.split(micro), labels.split(micro))]).loss
        trainer.optimizer.wait_params()
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(probe)
        biases = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith(BUFFER)}
    return loss, logits, biases


LAYOUTS = [("gpt_torch", {"tp": 2}), ("gpt_torch_dist", {"distributed_optimizer": True}),
           ("llama_torch", {"distributed_optimizer": True}), ("llama_torch_dist", {"tp": 2}), ("qwen_torch", {"tp": 2}),
           ("llama_dp1_torch_dist", {"tp": 2}), ("gpt_vp_dp2_torch_dist", {"distributed_optimizer": True}),
           ("moe_vp_torch", {"ep": 2}), ("moe_torch_dist", {"ep": 2, "distributed_optimizer": True}),
           ("mla_pp2_torch", {"tp": 2})]


@pytest.mark.parametrize(("name", "parallel"), LAYOUTS)
def test_the_next_step_is_megatrons(name, parallel, megatron, converted):
    """Two ranks (tp 2, dp 2 with the distributed optimizer, or the MoE fixtures' experts over ep 2) resume the
    converted checkpoint and take the step Megatron took after saving it: the same loss and the same logits
    after the step, so the weights, Adam's moments and step, the experts, router and expert bias carried over,
    and the step's gradients are Megatron's (the balancing loss's too: one per micro batch, counting the plain
    top-k of the scores); the expert biases move as Megatron's did. The GPT keeps its padded vocabulary rows
    scored as Megatron does (model.vocab_size = the padded size); with its real size megalite leaves them out of
    the softmax."""
    want = expected(megatron, name)
    padded = 64
    batch = {"tokens": want["step_tokens"], "labels": want["step_labels"]}
    results = run_ranks(2, _next_step, converted[name], parallel, batch, want["tokens"], padded)
    layers = want.get("expert_bias_layers", torch.empty(0)).tolist()
    moved = dict(zip(layers, want.get("expert_bias_after_step", ())))  # by layer: Megatron's biases after the step
    for loss, logits, biases in results:
        assert loss == pytest.approx(float(want["step_loss"]), abs=1e-6)
        torch.testing.assert_close(logits[..., : want["logits_after_step"].shape[-1]], want["logits_after_step"],
                                   atol=2e-6, rtol=0)
        assert biases.keys() == {f"layers.{layer}{BUFFER}" for layer in moved}
        for layer, bias in moved.items():
            assert torch.equal(biases[f"layers.{layer}{BUFFER}"], bias), layer


@pytest.mark.parametrize("name", ["llama_dp1_torch_dist", "gpt_vp_dp2_torch_dist", "moe_vp_torch", "moe_torch_dist",
                                  "mla_torch", "mla_moe_torch_dist"])
def test_flat_state_main_weights_are_the_weights(name, megatron):
    """The distributed optimizer's fp32 main weights, cut out of its flat buckets at the places megalite's
    reading of Megatron's buffer layout gives, equal the saved weights (fp32 training) for every parameter: each
    parameter's place (order, padding, buckets, dp groups, vp chunks, experts over ep) is right."""
    state = read_megatron(megatron[name], lambda args: None)
    assert state.optimizer.keys() >= {n for n in state.weights if not n.endswith(BUFFER)}
    for n, weight in state.weights.items():
        if not n.endswith(BUFFER):
            assert torch.equal(state.optimizer[n][MAIN], weight), n


def test_without_optimizer_state_only_the_weights_carry_over(megatron, tmp_path):
    convert("--from-megatron", "--no-optimizer", "--load", str(megatron["llama_torch"]), "--save", str(tmp_path))
    index = json.loads((tmp_path / "iter_0000003" / "index.json").read_text())
    assert {piece["kind"] for piece in index["pieces"]} == {"model"}


class NotMegatron:
    """A class no Megatron checkpoint refers to: unpickling it would run this module's code."""


def _rewrite_rank_file(path: Path, change) -> None:
    """Re-save a legacy rank file after `change(saved)`, its args as a plain namespace (Megatron's enums as their
    values: this test has no Megatron to pickle them with) and without the RNG state."""
    saved = load_megatron_pickle(path, str(path))
    saved["args"].__dict__.update({k: getattr(v, "value", v) for k, v in vars(saved["args"]).items()
                                   if type(v).__module__.startswith("megalite")})
    saved.pop("rng_state", None)
    change(saved)
    torch.save(saved, path)


def _fails(load: Path, save: Path, capsys) -> str:
    with pytest.raises(SystemExit):
        convert("--from-megatron", "--load", str(load), "--save", str(save))
    return capsys.readouterr().err


def test_unknown_keys_and_options_are_named(megatron, tmp_path, capsys):
    work = tmp_path / "gpt"
    shutil.copytree(megatron["gpt_torch"], work)
    rank_file = work / "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
    mla = "decoder.layers.1.self_attention.linear_qkv_down_proj.weight"  # --mla-down-proj-fusion's
    _rewrite_rank_file(rank_file, lambda s: s["model"].update({mla: torch.ones(2)}))
    assert f"tensor '{mla}' has no place in megalite's model" in _fails(work, tmp_path / "a", capsys)
    _rewrite_rank_file(rank_file, lambda s: setattr(s["args"], "num_experts", 8))
    assert "args.add_bias_linear=True with experts (megalite's router and experts have no biases)" in _fails(
        work, tmp_path / "b", capsys)
    torch.save({"args": NotMegatron()}, rank_file)
    assert "test_megatron_convert.NotMegatron" in _fails(work, tmp_path / "c", capsys)
    shutil.rmtree(work)
    shutil.copytree(megatron["gpt_torch"], work)
    (work / "iter_0000003/mp_rank_01_001/model_optim_rng.pt").unlink()
    assert "mp_rank_01_001/model_optim_rng.pt is missing" in _fails(work, tmp_path / "d", capsys)


def test_flat_buckets_that_do_not_add_up_are_named(megatron, tmp_path, capsys):
    """The distributed optimizer's default torch_dist state (flat buckets) whose recorded bucket sizes do not fit
    the parameters stops, naming the rank, the parameter and the numbers; --no-optimizer still carries the
    weights (which never depend on the optimizer's layout)."""
    work = tmp_path / "llama"
    shutil.copytree(megatron["llama_dp1_torch_dist"], work)
    found = work / "iter_0000003"
    metadata = load_dcp_metadata(found / ".metadata")
    key = "optimizer.distributed.dp_group_idx_1.per_bucket_numel_unpadded/shard_0_1"
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
    with open(found / info.relative_path, "rb") as f:
        f.seek(info.offset)
        sizes = load_megatron_pickle(f.read(info.length), key)
    (dtype, [size]), = sizes[0][0].items()
    buffer = io.BytesIO()
    torch.save([[{dtype: [size - 64]}]], buffer)
    (found / "__bad.distcp").write_bytes(buffer.getvalue())
    metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == key)] = dataclasses.replace(
        info, relative_path="__bad.distcp", offset=0, length=len(buffer.getvalue()))
    (found / ".metadata").write_bytes(pickle.dumps(metadata))
    err = _fails(work, tmp_path / "out", capsys)
    assert (f"optimizer.distributed.dp_group_idx_1 buffer 0 (model chunk 0): embedding.word_embeddings.weight "
            f"ends at element {size} of bucket 0, whose recorded size is {size - 64} (buckets [{size - 64}])") in err
    convert("--from-megatron", "--no-optimizer", "--load", str(work), "--save", str(tmp_path / "weights"))
    index = json.loads((tmp_path / "weights/iter_0000003/index.json").read_text())
    assert {piece["kind"] for piece in index["pieces"]} == {"model"}


def test_pretrain_continues_the_megatron_run(converted, tmp_path):
    """pretrain_gpt.py resumes the converted checkpoint as the README says, at a layout of its own (pp 2 on two
    processes): from Megatron's iteration (3) and consumed samples (6) on."""
    root = converted["llama_torch_dist"]
    metrics_file = tmp_path / "metrics.jsonl"
    pretrain_torchrun(2, ["--config", str(root / "iter_0000003/config.yaml"), f"--checkpoint.load={root}",
                          f"--checkpoint.save={tmp_path / 'run'}", "--parallel.tp=1", "--parallel.pp=2",
                          "--parallel.distributed_optimizer=false", "--data.mock=true", "--data.num_workers=0",
                          "--train.train_iters=5", "--logging.log_interval=1", "--logging.progress_bar=false",
                          f"--logging.metrics_file={metrics_file}"])
    assert [r["step"] for r in metrics(metrics_file)] == [4, 5]
    state = json.loads((tmp_path / "run/iter_0000005/state.json").read_text())
    assert state["consumed_samples"] == 6 + 2 * 2


def test_a_common_pt_file_holds_the_common_state_before_mid_2026(megatron, converted, tmp_path):
    """Megatron before mid-2026 saved the torch_dist common state as common.pt beside the distcp files."""
    work = tmp_path / "older"
    shutil.copytree(megatron["gpt_torch_dist"], work)
    found = work / "iter_0000003"
    metadata = load_dcp_metadata(found / ".metadata")
    entry = next(index for index in metadata.storage_data if index.fqn.startswith("common_state/"))
    info = metadata.storage_data.pop(entry)
    with open(found / info.relative_path, "rb") as f:
        f.seek(info.offset)
        (found / "common.pt").write_bytes(f.read(info.length))
    del metadata.state_dict_metadata[entry.fqn]
    (found / ".metadata").write_bytes(pickle.dumps(metadata))
    convert("--from-megatron", "--load", str(work), "--save", str(tmp_path / "out"))
    assert (tmp_path / "out/iter_0000003/index.json").read_text() == (
        converted["gpt_torch_dist"] / "iter_0000003/index.json").read_text()


def flat_ranges(numels: list[tuple[str, int, bool]], size: int | None) -> tuple[dict[str, range], int]:
    """Each parameter's elements in the legacy format's coalesced state, and its size."""
    slots, sizes = bucket_slots([Param(*n) for n in numels], "buffer", bucket_size=size)
    return coalesced(slots, sizes), sum(sizes)


def test_the_flat_layout_follows_megatrons_buffer():
    """A tied GPT's first stage under pipeline parallelism: parameters laid out in reverse order from 0, each
    start rounded up to 64 elements (b at 0, a at 128), the embedding's copy in a bucket of its own that starts
    where the previous bucket's unpadded elements end (192: the padded start a next parameter would get)."""
    where, total = flat_ranges([("emb", 100, True), ("a", 10, False), ("b", 70, False)], None)
    assert where == {"b": range(0, 70), "a": range(128, 138), "emb": range(192, 292)} and total == 292
    where, total = flat_ranges([("a", 10, False), ("b", 70, False), ("c", 5, False)], 70)  # b fills bucket 0
    assert where == {"c": range(0, 5), "b": range(64, 134), "a": range(134, 144)} and total == 144


def test_megatrons_gelu_is_the_tanh_form_where_fused():
    """Megatron-Core's GPT MLP: the bias-GELU fusion (its default with biases) and Transformer Engine's
    activation compute GELU's tanh form, the plain path exact GELU; SwiGLU is SiLU."""
    fused = argparse.Namespace(swiglu=False, add_bias_linear=True, bias_gelu_fusion=True)
    assert activation(fused) == "gelu_tanh"
    assert activation(argparse.Namespace(**vars(fused) | {"bias_gelu_fusion": False})) == "gelu"
    assert activation(argparse.Namespace(**vars(fused) | {"bias_gelu_fusion": False,
                                                           "use_te_activation_func": True})) == "gelu_tanh"
    assert activation(argparse.Namespace(**vars(fused) | {"swiglu": True})) == "silu"
