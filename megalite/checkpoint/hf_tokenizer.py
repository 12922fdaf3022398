"""Tokenizers between a megalite config (`data.tokenizer_*`) and a Hugging Face model directory.

An exported model is only usable with the tokenizer it was trained with, so `--to-hf` writes
it next to the weights in the form `AutoTokenizer.from_pretrained(dir)` reads, encoding text
to the ids megalite trained on; `--from-hf` keeps the HF tokenizer with the checkpoint, so
continued pretraining and generation use the model's own vocabulary.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import sentencepiece
from tokenizers import models, normalizers
from sentencepiece import sentencepiece_model_pb2

from megalite.config import DataConfig
from megalite.data.build import tokenizer_from_config
from megalite.data.tokenizers import SentencePieceTokenizer

TOKENIZER_DIR = "tokenizer"


def _resolved(data: DataConfig, source: str) -> DataConfig:
    """`data` with its tokenizer paths checked: they are relative to the directory training ran in."""
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(data, name)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{source}: data.{name}={path} does not exist (relative paths are taken from the current "
                                    "directory: run the conversion where training ran, or fix the path in config.yaml)")
    return data


def hf_tokenizer(data: DataConfig, vocab_size: int, source: str):
    """The transformers tokenizer equivalent to the one `data` names, or None without one (NullTokenizer
    has no text form). `source` names the config in errors."""
    import transformers

    if data.tokenizer_type in (None, "NullTokenizer"):
        return None
    data = _resolved(data, source)
    if data.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(data.tokenizer_model):
        return transformers.AutoTokenizer.from_pretrained(data.tokenizer_model, local_files_only=True)
    ours = tokenizer_from_config(data, vocab_size)
    if isinstance(ours, SentencePieceTokenizer):
        return _sentencepiece_as_llama(data.tokenizer_model)
    eod = ours._backend.id_to_token(ours.eod)  # GPT-2 BPE or a bare tokenizer.json: wrap the same backend
    return transformers.PreTrainedTokenizerFast(tokenizer_object=ours._backend, bos_token=eod, eos_token=eod, unk_token=eod)


def _sentencepiece_as_llama(model_file: str):
    """A LlamaTokenizer giving SentencePiece's own ids for a Llama-style (BPE, byte-fallback) model.

    transformers converts the .model when it loads a directory holding it as tokenizer.model, but
    orders the BPE merges by piece id and splits words with a Metaspace pre-tokenizer. SentencePiece
    merges by piece score, and Llama/Mistral models give their whitespace pieces ("▁▁", "▁▁▁", ...)
    low ids but the lowest scores, so text with runs of spaces (indented verse) or a leading space
    tokenized differently. The model is rebuilt the way Llama's own tokenizer.json is: merges by
    score, the dummy prefix and spaces as "▁" in the normalizer, no pre-tokenizer.
    """
    import transformers
    from transformers.tokenization_utils_base import generate_merges

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        tokenizer = transformers.LlamaTokenizer.from_pretrained(tmp, local_files_only=True)
    backend, spec = tokenizer.backend_tokenizer, sentencepiece_model_pb2.ModelProto.FromString(Path(model_file).read_bytes())
    if not isinstance(backend.model, models.BPE):  # a unigram model: transformers keeps SentencePiece's scores
        return tokenizer
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    merges = generate_merges({p: i for i, p in enumerate(pieces)}, {p: sp.get_score(i) for i, p in enumerate(pieces)})
    old = backend.model
    backend.model = models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token=old.unk_token, fuse_unk=old.fuse_unk,
                               byte_fallback=old.byte_fallback)
    prefix = [normalizers.Prepend("▁")] if spec.normalizer_spec.add_dummy_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    return tokenizer


def has_tokenizer(directory: Path) -> bool:
    """Whether an HF model directory ships tokenizer files."""
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def keep_tokenizer(tokenizer, root: Path) -> dict[str, str]:
    """Save an HF tokenizer under checkpoint root/tokenizer; the data config fields that name it."""
    target = root / TOKENIZER_DIR
    tokenizer.save_pretrained(target)
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(target.resolve())}
