"""Every family megalite converts, with the features its released models have (tests/hf_models.py FAMILIES: Qwen2's
q/k/v biases, Qwen2-MoE's gated shared expert, Qwen3's heads wider than hidden / heads, Llama 3's RoPE scaling,
Mistral with and without its sliding window, gpt-oss, GPT-2 with exact GELU), through the whole path (windows
shorter than the 40 tokens compared and the 32 trained on; greedy generation through the windowed KV cache):
a tiny random transformers model converts in
(tools/convert_checkpoint.py --from-hf) with transformers' logits and back out bit-exact, trains three steps at
tp 2 x pp 2 (sequence parallel; all families in one spawned group of four gloo ranks), and converts out to a model
transformers loads with no missing or unexpected weights, megalite's logits and its greedy generations. A
tokenizer with a chat template goes both ways as its files, unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from distributed import pretrain_each, run_ranks
from hf_models import FAMILIES, chat_tokenizer, random_hf
from test_hf_convert import _same_logits, convert, hf_tensors

from megalite.checkpoint.hf_tokenizer import TOKENIZER_DIR, TOKENIZER_FILES
from megalite.inference.generate import Sampling, generate, load_model

WITH_CHAT_TOKENIZER = "qwen2"


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> Path:
    """A directory per family: hf_in (the random HF model), megalite (converted in) and trained (from it)."""
    root = tmp_path_factory.mktemp("families")
    runs = []
    for name in FAMILIES:
        d = root / name
        random_hf(name).save_pretrained(d / "hf_in")
        if name == WITH_CHAT_TOKENIZER:
            chat_tokenizer().save_pretrained(d / "hf_in")
        convert("--from-hf", "--load", str(d / "hf_in"), "--save", str(d / "megalite"))
        runs.append(["--config", str(d / "megalite/iter_0000000/config.yaml"), f"--checkpoint.load={d / 'megalite'}",
                     f"--checkpoint.save={d / 'trained'}", "--parallel.tp=2", "--parallel.pp=2",
                     "--parallel.sequence_parallel=true", "--model.seq_length=32", "--train.micro_batch_size=2",
                     "--train.global_batch_size=4", "--train.train_iters=3", "--optim.lr=1e-2", "--data.mock=true",
                     "--data.num_workers=0", "--logging.progress_bar=false"])
    run_ranks(4, pretrain_each, runs)
    return root


def _loaded(directory: Path, architecture: str) -> transformers.PreTrainedModel:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert type(hf).__name__ == architecture
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    return hf.eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_converts_in_trains_at_tp2_pp2_and_converts_out(name, families, tmp_path):
    d, architecture = families / name, FAMILIES[name][1]
    hf_in = transformers.AutoModelForCausalLM.from_pretrained(d / "hf_in").eval()
    tokens = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    model, _, _ = load_model(d / "megalite", torch.device("cpu"))
    _same_logits(f"{name} in", model, hf_in, tokens)
    convert("--to-hf", "--load", str(d / "megalite"), "--save", str(tmp_path / "hf_back"))
    _loaded(tmp_path / "hf_back", architecture)
    before, after = hf_tensors(d / "hf_in"), hf_tensors(tmp_path / "hf_back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    convert("--to-hf", "--load", str(d / "trained"), "--save", str(tmp_path / "hf_out"))
    hf_out = _loaded(tmp_path / "hf_out", architecture)
    trained, _, _ = load_model(d / "trained", torch.device("cpu"))
    with torch.no_grad():
        assert (trained(tokens) - model(tokens)).abs().max() > 1e-2  # training moved the weights
    _same_logits(f"{name} trained, out", trained, hf_out, tokens)
    prompt = tokens[0, :12].tolist()
    ours = generate(trained, prompt, Sampling(max_new_tokens=16, temperature=0))
    theirs = hf_out.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()


def test_a_tokenizer_with_a_chat_template_goes_both_ways_unchanged(families, tmp_path):
    """Its files are copied, not loaded and saved again (which would rewrite tokenizer_config.json in the installed
    transformers' form), into the megalite checkpoint and out of the trained one."""
    d = families / WITH_CHAT_TOKENIZER
    convert("--to-hf", "--load", str(d / "trained"), "--save", str(tmp_path / "hf_out"))
    shipped = [name for name in TOKENIZER_FILES if (d / "hf_in" / name).is_file()]
    assert "chat_template.jinja" in shipped and "tokenizer_config.json" in shipped
    for directory in (d / "megalite" / TOKENIZER_DIR, tmp_path / "hf_out"):
        assert all((directory / f).read_bytes() == (d / "hf_in" / f).read_bytes() for f in shipped), directory
    chat = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    out = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out")
    assert out.apply_chat_template(chat, tokenize=False) == chat_tokenizer().apply_chat_template(chat, tokenize=False)
