"""The README's "Continue pretraining a Hugging Face model", end to end on miniatures of the models its examples
continue: Llama-3.1-8B (Llama 3.1's RoPE scaling), Qwen3-8B (128-wide heads, q/k norms) and gpt-oss-20b (sinks,
windows, YaRN, biased experts, at ep 2 instead of 8), each saved by
transformers with a tokenizer (tests/hf_models.py tiny_released, chat_tokenizer), converted by
tools/convert_checkpoint.py --from-hf, then trained by pretrain_gpt.py's pretrain with its example's config
(examples/llama_8b_continue.yaml, qwen3_8b_continue.yaml): the model's shape taken from the converted config, and
the world (4 ranks: the examples' tp 2 with sequence parallelism and the distributed optimizer, dp 2), batch, steps
and sample length made tiny, in fp32 so that losses compare exactly. The runs share one spawned group.

Every sample is the same 65 tokens (identical 64-token documents), so the first step's loss is the converted
model's loss on them whatever the sample order: it equals transformers' loss on that sample within 1e-5. The
miniatures' features show in that loss: without the RoPE scaling Llama's would differ by 2e-3, with Qwen3's q/k
norm weights lost (all 1) Qwen3's by 5e-3."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from distributed import metrics, pretrain_each, run_ranks
from hf_models import chat_tokenizer, tiny_released
from test_examples import CONTINUED, EXAMPLES
from test_hf_convert import convert

from megalite.checkpoint.model_io import resolve_checkpoint
from megalite.config_cli import config_from_yaml_text, parse_config
from megalite.data.indexed_dataset import IndexedDatasetWriter

STEPS = 3
# The examples' layouts made to fit the 4 ranks: gpt-oss-20b's ep 8 (its 8 GPUs) becomes ep 2
FOUR_RANKS = {"gpt_oss_20b_continue": ["--parallel.ep=2"]}


def _document(tokenizer: transformers.PreTrainedTokenizerFast) -> list[int]:
    """63 random words of chat_tokenizer's vocabulary, tokenized, and the end-of-document token."""
    words = torch.randint(0, 246, (63,), generator=torch.Generator().manual_seed(0)).tolist()
    return tokenizer(" ".join(f"w{i}" for i in words))["input_ids"] + [tokenizer.eos_token_id]


def _model_shape(example: Path, converted: Path) -> list[str]:
    """--model.FIELD=VALUE for every model field in which the converted checkpoint's config differs from the
    example's, but seq_length (the context to train at)."""
    ours = parse_config(["--config", str(example)]).model
    theirs = config_from_yaml_text((converted / "config.yaml").read_text(), str(converted)).model
    theirs = dataclasses.replace(theirs, seq_length=ours.seq_length)
    return [f"--model.{f.name}={getattr(theirs, f.name)}" for f in dataclasses.fields(theirs)
            if getattr(theirs, f.name) != getattr(ours, f.name)]


@pytest.fixture(scope="module")
def continued(tmp_path_factory) -> Path:
    """A directory per example: hf (the miniature, with its tokenizer) and megalite (converted, trained in place)."""
    root = tmp_path_factory.mktemp("continued")
    tokenizer = chat_tokenizer()
    with IndexedDatasetWriter(str(root / "documents"), np.uint16) as writer:
        for _ in range(8):
            writer.add_document(np.array(_document(tokenizer)))
    runs = []
    for stem, name in CONTINUED.items():
        d = root / stem
        tiny_released(name).save_pretrained(d / "hf")
        tokenizer.save_pretrained(d / "hf")
        convert("--from-hf", "--load", str(d / "hf"), "--save", str(d / "megalite"))
        example = EXAMPLES / f"{stem}.yaml"
        runs.append(["--config", str(example), *_model_shape(example, resolve_checkpoint(d / "megalite")),
                     f"--checkpoint.load={d / 'megalite'}", f"--checkpoint.save={d / 'megalite'}",
                     f"--data.tokenizer_model={d / 'megalite' / 'tokenizer'}", f"--data.paths={root / 'documents'}",
                     "--data.split=1,0,0", f"--data.cache_dir={d / 'cache'}", "--data.num_workers=0",
                     "--model.seq_length=64", "--train.micro_batch_size=1", "--train.global_batch_size=4",
                     f"--train.train_iters={STEPS}", "--optim.warmup_iters=1", "--train.precision=fp32",
                     "--train.param_dtype=fp32", "--logging.log_interval=1", f"--logging.metrics_file={d / 'metrics'}",
                     "--logging.progress_bar=false", *FOUR_RANKS.get(stem, [])])
    run_ranks(4, pretrain_each, runs)
    return root


@pytest.mark.parametrize("stem", CONTINUED)
def test_a_converted_model_continues_from_transformers_loss(stem, continued):
    d = continued / stem
    hf = transformers.AutoModelForCausalLM.from_pretrained(d / "hf").eval()
    document = _document(chat_tokenizer())
    sample = torch.tensor(document + document[:1])
    with torch.no_grad():
        expected = F.cross_entropy(hf(sample[None, :-1]).logits[0], sample[1:]).item()
    losses = [r["loss"] for r in metrics(d / "metrics")]
    print(f"{stem} continued: losses {losses}, transformers' loss on the sample {expected:.6f}")
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]
    assert resolve_checkpoint(d / "megalite").name == f"iter_{STEPS:07d}"  # a relaunch continues from there
