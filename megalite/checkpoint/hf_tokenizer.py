"""Tokenizers between a megalite config (`data.tokenizer_*`) and a Hugging Face model directory.

An exported model is only usable with the tokenizer it was trained with, so `--to-hf` writes
it next to the weights in the form `AutoTokenizer.from_pretrained(dir)` reads, encoding text
to the ids megalite trained on; `--from-hf` keeps the HF tokenizer with the checkpoint, so
continued pretraining and generation use the model's own vocabulary. A tokenizer that came from an HF
directory goes both ways as its files, byte for byte (chat templates, special tokens and all): loading
and saving it again would rewrite them in the installed transformers' own form.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import sentencepiece
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, models, normalizers

from megalite.config import DataConfig
from megalite.data.build import tokenizer_from_config
from megalite.data.tiktoken_dir import load_pretrained_tokenizer, tokenizer_config
from megalite.data.tokenizers import SentencePieceTokenizer

TOKENIZER_DIR = "tokenizer"


def _check_paths(data: DataConfig, source: str) -> None:
    """The tokenizer files exist (relative paths are relative to the directory training ran in)."""
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(data, name)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{source}: data.{name}={path} does not exist (relative paths are taken from "
                                    "the current directory: run the conversion where training ran, or fix the path "
                                    "in config.yaml)")


def hf_tokenizer(data: DataConfig, vocab_size: int, source: str):
    """The transformers tokenizer equivalent to the one `data` names, or None without one (NullTokenizer
    has no text form). `source` names the config in errors."""
    import transformers

    if data.tokenizer_type in (None, "NullTokenizer"):
        return None
    _check_paths(data, source)
    if data.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(data.tokenizer_model):
        return load_pretrained_tokenizer(data.tokenizer_model)
    ours = tokenizer_from_config(data, vocab_size)
    if isinstance(ours, SentencePieceTokenizer):
        return _sentencepiece_as_llama(data.tokenizer_model)
    # GPT-2 BPE or a bare tokenizer.json: wrap the very tokenizers object megalite encoded with
    eod = ours.backend.id_to_token(ours.eod)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, bos_token=eod, eos_token=eod,
                                                unk_token=eod)


def _sentencepiece_as_llama(model_file: str):
    """An HF tokenizer giving SentencePiece's own ids for a SentencePiece BPE model.

    transformers converts the .model when it loads a directory holding it as tokenizer.model, but
    orders the BPE merges by piece id, splits words with a Metaspace pre-tokenizer and drops the
    model's normalisation. SentencePiece merges by piece score, and Llama/Mistral models give their
    whitespace pieces ("▁▁", "▁▁▁", ...) low ids but the lowest scores, so text with runs of spaces
    (indented verse) or a leading space tokenized differently. The model is rebuilt the way Llama's
    own tokenizer.json is (merges by score, no pre-tokenizer) with SentencePiece's normaliser
    steps: its character map, whitespace collapsing, dummy prefix, spaces as "▁"; unknown
    characters fused into one <unk> as SentencePiece does. It is saved as a plain tokenizers-backed
    tokenizer: LlamaTokenizer would impose its own pre-tokenizer again when loaded.
    """
    import transformers
    from transformers.tokenization_utils_base import generate_merges

    proto = sentencepiece_model_pb2.ModelProto.FromString(Path(model_file).read_bytes())
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        kind = proto.trainer_spec.ModelType.Name(proto.trainer_spec.model_type)
        raise ValueError(f"data.tokenizer_model={model_file} is a SentencePiece {kind} model; exporting it to "
                         "Hugging Face is supported for BPE models (Llama, Mistral) only")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        tokenizer = transformers.LlamaTokenizer.from_pretrained(tmp, local_files_only=True)
    backend = tokenizer.backend_tokenizer
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = generate_merges(vocab, {piece: sp.get_score(i) for piece, i in vocab.items()})
    backend.model = models.BPE(vocab, merges, unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
                               byte_fallback=backend.model.byte_fallback)
    spec = proto.normalizer_spec
    collapse = [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")] if spec.remove_extra_whitespaces else []
    prefix = [normalizers.Prepend("▁")] if spec.add_dummy_prefix else []
    charsmap = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    backend.normalizer = normalizers.Sequence([*charsmap, *collapse, *prefix, normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    special = {f"{name}_token": getattr(tokenizer, f"{name}_token") for name in ("bos", "eos", "unk")}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special)


# The files an HF tokenizer may consist of (transformers v5 writes some of them, older versions others, Kimi K2
# and Moonlight publish tiktoken.model), and the folder v5 keeps named chat templates in.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "tiktoken.model")
CHAT_TEMPLATES_DIR = "additional_chat_templates"


def has_tokenizer(directory: Path) -> bool:
    """Whether an HF model directory ships tokenizer files."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """Copy the tokenizer files of HF directory `source` into `target` unchanged."""
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES + _remote_code(source):
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if (source / CHAT_TEMPLATES_DIR).is_dir():
        shutil.copytree(source / CHAT_TEMPLATES_DIR, target / CHAT_TEMPLATES_DIR, dirs_exist_ok=True)


def _remote_code(source: Path) -> tuple[str, ...]:
    """The modules of HF directory `source` that its tokenizer_config.json's auto_map names (Kimi's
    tokenization_kimi.py): copied, never run, so that the directory still loads where its users trust remote code."""
    classes = tokenizer_config(source).get("auto_map", {}).get("AutoTokenizer", [])
    names = classes if isinstance(classes, list) else [classes]
    return tuple(sorted({f"{name.split('.')[0]}.py" for name in names if isinstance(name, str) and "--" not in name}))


def save_tokenizer(tokenizer, data: DataConfig, target: Path) -> None:
    """Write `tokenizer` (hf_tokenizer's for `data`) into HF directory `target`: a Hugging Face tokenizer directory's
    files as they are, any other tokenizer as transformers saves it."""
    if data.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(data.tokenizer_model):
        copy_tokenizer_files(Path(data.tokenizer_model), target)
    else:
        tokenizer.save_pretrained(target)


def keep_tokenizer(tokenizer, root: Path, source: Path | None = None) -> dict[str, str]:
    """Keep an HF tokenizer under checkpoint root/tokenizer: the files of HF directory `source` unchanged, or (a
    GGUF's) as transformers saves it; the data config fields that name it."""
    target = root / TOKENIZER_DIR
    if source is not None and has_tokenizer(source):
        copy_tokenizer_files(source, target)
    else:
        tokenizer.save_pretrained(target)
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(target.resolve())}
