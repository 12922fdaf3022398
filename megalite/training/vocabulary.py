"""The vocabulary a run's model embeds, decided once before the model is built (by the run and by `--check`).

Released models often embed more rows than their tokenizer has ids (Qwen3-8B: 151936 rows for 151669 ids;
gpt-oss: 201088 rows), and those rows are the checkpoint's shapes: a model sized by the tokenizer could not
load them. So, as Megatron-Bridge does with a Hugging Face config's vocab_size, what fixes the vocabulary is,
in order: model.vocab_size where the config gives it (the converter's config.yaml, an example, the command
line); else the checkpoint the run continues (the vocab_size of its config.yaml); else the tokenizer, its
largest id + 1 (a fresh run, as before); else GPT-2's 50257 (mock data). A NullTokenizer's ids are
model.vocab_size + 1 (Megatron-LM's --vocab-size), so it sets the vocabulary itself. Whatever fixed it, the
tokenizer's ids must fit inside it, or the run stops before building anything, naming both and the fix. A
model.vocab_size other than the checkpoint's is left for the resume check to refuse, naming both.
"""

from __future__ import annotations

from pathlib import Path

from megalite.checkpoint.compatibility import saved_model
from megalite.checkpoint.local import checkpoint_candidates
from megalite.checkpoint.resume import where_to_resume
from megalite.config import Config
from megalite.data.build import training_tokenizer, vocabulary
from megalite.data.tokenizers import NullTokenizer, Tokenizer
from megalite.errors import InvalidInput, MissingInput


class VocabularyTooSmall(InvalidInput):
    """A tokenizer with ids the model has no embedding row for."""


def set_vocabulary(cfg: Config) -> tuple[Tokenizer | None, str]:
    """The run's tokenizer (None with mock data) and what fixed model.vocab_size, which this sets in `cfg`."""
    m = cfg.model
    tokenizer = training_tokenizer(cfg.data, m.vocab)
    given = m.vocab_size
    saved = None if given is not None or isinstance(tokenizer, NullTokenizer) else _saved_vocabulary(cfg)
    if isinstance(tokenizer, NullTokenizer):
        m.vocab_size, source = tokenizer.vocab_size, "NullTokenizer: model.vocab_size + 1 ids"
    elif given is not None:
        source = "set in the config"
    elif saved is not None:
        m.vocab_size, source = saved[1], f"the checkpoint's, {saved[0]}"
    elif tokenizer is not None:
        m.vocab_size, source = tokenizer.vocab_size, "the tokenizer's"
    else:
        m.vocab_size, source = m.vocab, "the default, for mock data"
    if tokenizer is not None and tokenizer.vocab_size > m.vocab_size:
        raise VocabularyTooSmall(_too_small(cfg, tokenizer.vocab_size, saved[0] if saved else None))
    return tokenizer, source


def _saved_vocabulary(cfg: Config) -> tuple[Path, int] | None:
    """(checkpoint, its model.vocab_size) for the checkpoint a run would resume from; None where there is none
    yet, or it cannot be read (the resume names that problem)."""
    try:
        load = where_to_resume(cfg.checkpoint)[0]
        candidates = checkpoint_candidates(load)[0] if load else []
    except MissingInput:
        return None
    if not candidates or not (candidates[0] / "config.yaml").is_file():
        return None
    return candidates[0], saved_model(candidates[0]).vocab


def _too_small(cfg: Config, ids: int, checkpoint: Path | None) -> str:
    tokenizer, size = vocabulary(cfg, ids).tokenizer, cfg.model.vocab_size
    if checkpoint is not None:
        return (f"{tokenizer} has {ids} ids (largest {ids - 1}), more than the {size} checkpoint {checkpoint} "
                f"embeds (model.vocab_size in its config.yaml): ids from {size} on have no embedding row. Fix: "
                "train with the tokenizer the checkpoint was made with (tools/convert_checkpoint.py --from-hf "
                "keeps a model's under the checkpoint's tokenizer/), or start a new run without checkpoint.load")
    return (f"{tokenizer} has {ids} ids (largest {ids - 1}), more than model.vocab_size={size}: ids from {size} "
            f"on have no embedding row. Fix: set model.vocab_size to at least {ids}, or leave it unset (the "
            "tokenizer sets it), or use the tokenizer the model is meant for")
