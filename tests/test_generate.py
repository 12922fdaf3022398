"""Generation (megalite/inference, tools/generate.py): greedy decoding with the KV cache equals
decoding without it and transformers' greedy generate on the converted model; the sampling
options keep to the tokens they allow."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers
from trained import passage

from megalite.checkpoint.hf_convert import megalite_to_hf
from megalite.inference.generate import Sampling, generate, load_model, next_token
from megalite.model.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_with_cache_equals_without_and_transformers(family, trained_checkpoint, assets, tmp_path):
    ckpt = trained_checkpoint(family)
    model, _, tok = load_model(ckpt, CPU)
    prompt = tok.encode(passage(assets, 120))[:24]
    greedy = Sampling(max_new_tokens=40, temperature=0, stop_tokens=(tok.eod,))
    cached = generate(model, prompt, greedy)
    assert cached == generate(model, prompt,
                              Sampling(max_new_tokens=40, temperature=0, stop_tokens=(tok.eod,), use_cache=False))
    hf = transformers.AutoModelForCausalLM.from_pretrained(megalite_to_hf(ckpt, tmp_path / "hf"))
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    assert cached == theirs and len(cached) > 1


def test_prefill_in_chunks_equals_one_pass(trained_checkpoint, assets):
    """Tokens continuing a cache attend to the cached ones and causally to each other."""
    model, _, tok = load_model(trained_checkpoint("llama"), CPU)
    tokens = torch.tensor([tok.encode(passage(assets))[:40]])
    cache = KVCache(40)
    with torch.no_grad():
        model(tokens[:, :15], cache=cache)
        second = model(tokens[:, 15:], cache=cache)
        torch.testing.assert_close(second, model(tokens)[:, 15:], atol=1e-5, rtol=0)
    assert cache.length == 40


def test_sampling_keeps_to_top_k_and_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = lambda sampling: {next_token(logits, sampling, torch.Generator().manual_seed(s)) for s in range(200)}  # noqa: E731
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(Sampling(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draws(Sampling(temperature=1.0, top_k=3, top_p=0.99)) == {0, 1, 2}
    assert draws(Sampling(temperature=0.0)) == {0}


def test_sampling_is_reproducible_by_seed(trained_checkpoint, assets):
    model, _, tok = load_model(trained_checkpoint("gpt2"), CPU)
    prompt = tok.encode("ROMEO:")
    runs = [generate(model, prompt, Sampling(max_new_tokens=12, temperature=0.9, top_k=40, seed=seed))
            for seed in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        generate(model, prompt, Sampling(max_new_tokens=64))


def test_cli_prints_prompt_and_continuation(trained_checkpoint, capsys):
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools/generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--load", str(trained_checkpoint("gpt2")), "--prompt", "To be", "--prompt", "ROMEO:",
               "--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9"])
    out = capsys.readouterr().out
    assert out.startswith("To be") and "\nROMEO:" in out and out.count("-" * 40) == 2
