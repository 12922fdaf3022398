"""Tokenizers behind one interface, under Megatron-LM's names, so a corpus preprocessed
for Megatron-LM (or for megalite) is read with the same ids, and config files carry over.

Every tokenizer loads from local files only: a missing file is a `FileNotFoundError` that
names the path and the config field / command-line flag to fix, never a silent download.
`encode` never adds special tokens: the end-of-document id (`eod`) is appended between
documents by the caller (tools/preprocess_data.py), as Megatron-LM does.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megalite.data.tiktoken_dir import CONFIG_FILE, RANKS_FILE, load_pretrained_tokenizer
from megalite.errors import InvalidInput, MissingInput

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer")

# Where each argument comes from: the config field and the preprocessing tool's flag.
_SOURCES = {
    "vocab_file": "data.vocab_file / --vocab-file",
    "merge_file": "data.merge_file / --merge-file",
    "tokenizer_model": "data.tokenizer_model / --tokenizer-model",
    "vocab_size": "model.vocab_size / --vocab-size",
}


class Tokenizer(ABC):
    """Text <-> token ids, plus the two numbers the rest of the pipeline needs."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model must embed (largest id + 1)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended after every document."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Same ids as `[encode(t) for t in texts]`, faster: the preprocessing hot path."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...


def _existing(path: str | None, arg: str, kind: str = "file") -> str:
    if path is None:
        raise InvalidInput(f"{arg} is required for this tokenizer: set {_SOURCES[arg]}")
    if not os.path.exists(path):
        raise MissingInput(f"{_SOURCES[arg]}: {kind} {path} does not exist")
    return path


class _RustTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer`, whose batch encoding runs in Rust threads
    (unless TOKENIZERS_PARALLELISM=false, as the preprocessing workers set)."""

    def __init__(self, backend: tokenizers.Tokenizer, eod: int) -> None:
        self._backend, self._eod = backend, eod
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The Rust tokenizer itself (exported as-is to Hugging Face directories)."""
        return self._backend

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # _fast skips character offsets (~13% faster); tokenizers >= 0.20, as transformers >= 4.45 needs.
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)


class GPT2BPETokenizer(_RustTokenizer):
    """GPT-2's byte-level BPE from vocab.json + merges.txt, id for id as OpenAI's encoder and
    Megatron-LM's GPT2BPETokenizer: `<|endoftext|>` in the text is ordinary text, not the
    special token (only `eod` is), and no prefix space is added.

    Built with `tokenizers` directly because transformers v5's
    `GPT2TokenizerFast(vocab_file=..., merges_file=...)` silently returns an empty tokenizer.
    """

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        backend = tokenizers.Tokenizer(_bpe(_existing(vocab_file, "vocab_file"), _existing(merge_file, "merge_file")))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        eod = backend.token_to_id("<|endoftext|>")
        if eod is None:
            raise InvalidInput(f"{_SOURCES['vocab_file']}: {vocab_file} has no <|endoftext|> token, "
                               "so it is not a GPT-2 vocabulary")
        super().__init__(backend, eod)


def _bpe(vocab_file: str, merge_file: str) -> models.BPE:
    """GPT-2's BPE model; a file that is not what it should be is named (the Rust error names none)."""
    try:
        return models.BPE.from_file(vocab_file, merge_file)
    except Exception as error:  # noqa: BLE001 - the Rust side raises a bare Exception
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab_ok = isinstance(json.load(f), dict)
        except (ValueError, OSError):
            vocab_ok = False
        field, path, kind = (("merge_file", merge_file, "merges.txt") if vocab_ok else
                             ("vocab_file", vocab_file, "vocab.json"))
        raise InvalidInput(f"{_SOURCES[field]}: {path} is not a GPT-2 BPE {kind} ({error}); give the vocab.json and "
                           "merges.txt of the tokenizer the corpus was preprocessed with") from None


class HuggingFaceTokenizer(_RustTokenizer):
    """A local Hugging Face tokenizer: a directory (what `save_pretrained` writes, or a tiktoken one as Kimi K2
    and Moonlight publish theirs: tiktoken_dir.py; its tokenizer_config.json names the eos token, the
    end-of-document id) or a bare tokenizer.json file, whose one special token is taken as eos.
    """

    def __init__(self, path: str | None) -> None:
        path = _existing(path, "tokenizer_model", "Hugging Face tokenizer directory or tokenizer.json")
        if os.path.isdir(path):
            backend, eod = self._from_directory(path)
        else:
            try:
                backend = tokenizers.Tokenizer.from_file(path)
            except Exception as e:  # the Rust side raises a bare Exception naming no file
                raise InvalidInput(f"{_SOURCES['tokenizer_model']}: {path} is not a tokenizer.json ({e})") from e
            special = sorted(t.content for t in backend.get_added_tokens_decoder().values() if t.special)
            if len(special) != 1:
                raise InvalidInput(
                    f"{_SOURCES['tokenizer_model']}: {path} has special tokens {special}, so which one ends a "
                    "document is ambiguous; pass a directory instead, saved with "
                    "transformers.PreTrainedTokenizerFast(tokenizer_file=..., eos_token=...).save_pretrained(dir)")
            eod = backend.token_to_id(special[0])
        super().__init__(backend, eod)

    @staticmethod
    def _from_directory(path: str) -> tuple[tokenizers.Tokenizer, int]:
        expected = ("tokenizer.json", CONFIG_FILE, RANKS_FILE)
        if not any(os.path.isfile(os.path.join(path, name)) for name in expected):
            raise InvalidInput(f"{_SOURCES['tokenizer_model']}: {path} has no {' or '.join(expected)}, so it is not a "
                               "Hugging Face tokenizer directory; give the directory save_pretrained wrote")
        loaded = load_pretrained_tokenizer(path)
        if loaded.eos_token_id is None:
            raise InvalidInput(f"{_SOURCES['tokenizer_model']}: the tokenizer in {path} has no eos token to end "
                               "documents with; set eos_token in its tokenizer_config.json")
        backend = getattr(loaded, "backend_tokenizer", None)
        if backend is None:
            raise InvalidInput(f"{_SOURCES['tokenizer_model']}: {path} loads as {type(loaded).__name__}, which has no "
                               "fast (tokenizers) backend; save it with save_pretrained from a fast tokenizer")
        return backend, loaded.eos_token_id


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece .model (Llama/Mistral style); end of document = its eos id."""

    def __init__(self, model_file: str | None) -> None:
        import sentencepiece  # only this tokenizer needs it, and GPU images without it still train with the others

        path = _existing(model_file, "tokenizer_model", "SentencePiece model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as error:
            raise InvalidInput(f"{_SOURCES['tokenizer_model']}: {path} is not a SentencePiece model ({error}); give "
                               "the .model file the corpus was preprocessed with") from None
        if self._sp.eos_id() < 0:
            raise InvalidInput(f"{_SOURCES['tokenizer_model']}: SentencePiece model {path} has no eos piece "
                               "to end documents with")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # SentencePiece threads a batch over every core; honour the switch HF tokenizers use,
        # so that N preprocessing workers do not start N x cores threads.
        serial = os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "no", "off")
        return self._sp.encode(texts, num_threads=1 if serial else -1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer(Tokenizer):
    """Megatron-LM's NullTokenizer: the text is already ids separated by whitespace, for
    benchmarks and tests; eod is one past the given vocabulary."""

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None:
            raise InvalidInput(f"vocab_size is required for NullTokenizer: set {_SOURCES['vocab_size']}")
        self._eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)


def build_tokenizer(tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer of a type in TOKENIZER_TYPES; arguments a type does not use are ignored."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise InvalidInput(f"unknown tokenizer type {tokenizer_type!r}; valid types: {', '.join(TOKENIZER_TYPES)}")
