"""Build the training and validation datasets a config asks for: synthetic tokens, or
preprocessed Megatron `.bin/.idx` prefixes, split by documents or given per split, blended
by weight.

Index files are built by global rank 0 into data.cache_dir while the other ranks wait at a
barrier, then every rank memory-maps them (the cache directory must be on a filesystem
all nodes see, as with Megatron-LM).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset

from megalite.config import Config, DataConfig
from megalite.data.batches import BatchMaker
from megalite.data.blending import BLEND_RULES, BlendedDataset, parse_blend
from megalite.data.gpt_dataset import GPTDataset, Vocabulary, split_documents
from megalite.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    data_file_path,
    stats_file_path,
    token_stats,
)
from megalite.data.mock import VALIDATION_OFFSET, MockDataset
from megalite.data.tokenizers import Tokenizer, build_tokenizer

TRAIN, VALID = 0, 1


@dataclass
class TrainingData:
    train: Dataset
    valid: Dataset | None
    maker: BatchMaker


def tokenizer_from_config(cfg: DataConfig, vocab_size: int) -> Tokenizer | None:
    if cfg.tokenizer_type is None:
        return None
    return build_tokenizer(cfg.tokenizer_type, vocab_file=cfg.vocab_file, merge_file=cfg.merge_file,
                           tokenizer_model=cfg.tokenizer_model, vocab_size=vocab_size)


def training_tokenizer(cfg: DataConfig, vocab_size: int) -> Tokenizer | None:
    """The tokenizer a training run reads its corpus with (training/vocabulary.py decides what it means for
    model.vocab_size; `vocab_size` is a NullTokenizer's). Mock data has none: its
    tokens are ids below model.vocab_size, so tokenizer files the config still names are never opened (they need
    not exist)."""
    return None if cfg.mock else tokenizer_from_config(cfg, vocab_size)


def vocabulary(cfg: Config, ids: int) -> Vocabulary:
    """The tokenizer's `ids`, named by its fields: a corpus id beyond them was made with another tokenizer, even
    where the model embeds more rows (a released model's padded embedding)."""
    d = cfg.data
    files = [f"data.{name}={getattr(d, name)}" for name in ("tokenizer_model", "vocab_file") if getattr(d, name)]
    return Vocabulary(ids, " ".join([f"data.tokenizer_type={d.tokenizer_type}", *files]))


def check_corpus(prefixes: list[str], vocab: Vocabulary) -> None:
    """Before any sample is read: no dataset is empty, none holds ids beyond the vocabulary by the largest id
    preprocessing recorded (when it did: Megatron-LM's datasets have no record, and their samples are checked as
    they are read), and a blend does not mix tokenizers."""
    recorded: dict[str, str] = {}
    for prefix in prefixes:
        if os.path.getsize(data_file_path(prefix)) == 0:
            raise IndexedDatasetError(f"{data_file_path(prefix)} holds no tokens: re-run tools/preprocess_data.py "
                                      "with the --json-keys field that holds the text")
        stats = token_stats(prefix) or {}
        largest = stats.get("max_token_id")
        if largest is not None:
            vocab.check(np.array([largest]), f"{prefix} (by {stats_file_path(prefix)}, written by preprocessing)")
        if stats.get("tokenizer"):
            recorded[json.dumps(stats["tokenizer"], sort_keys=True)] = prefix
    if len(recorded) > 1:
        (one, a), (other, b) = list(recorded.items())[:2]
        raise IndexedDatasetError(f"the blend mixes tokenizers: {a} was tokenized with {one}, {b} with {other}; "
                                  "preprocess every dataset with the same tokenizer")


def _split_dataset(prefix: str, split: str, index: int, num_samples: int, cfg: Config, rank: int,
                   vocab: Vocabulary) -> GPTDataset | None:
    documents = IndexedDataset(prefix)
    ids = split_documents(len(documents), split)[index]
    if len(ids) == 0:
        return None
    cache_dir = cfg.data.cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    return GPTDataset(
        documents, ids, num_samples, cfg.model.seq_length, cfg.train.seed, cache_dir,
        description=f"{os.path.abspath(prefix)} split={split} part={index}", is_builder=rank == 0,
        barrier=dist.barrier if dist.is_initialized() else None,  # one process without a group: nothing to wait for
        vocabulary=vocab,
    )


def _blend(paths: list[str], split: str, index: int, num_samples: int, cfg: Config, rank: int,
           vocab: Vocabulary) -> Dataset | None:
    """The blend of `paths` for split part `index`, sized and ordered by data.blend_rule. Megatron-Core blends
    a weighted single prefix ("1.0 prefix") too, with its surplus, so blend_rule=megatron does the same."""
    weights, prefixes = parse_blend(paths)
    check_corpus(prefixes, vocab)
    megatron = cfg.data.blend_rule == "megatron"
    if len(prefixes) == 1 and not (megatron and len(paths) > 1):
        return _split_dataset(prefixes[0], split, index, num_samples, cfg, rank, vocab)
    rule = BLEND_RULES[cfg.data.blend_rule]
    sizes, length = rule.sizes(weights, num_samples)
    parts = [_split_dataset(p, split, index, n, cfg, rank, vocab) for p, n in zip(prefixes, sizes)]
    kept = [(w, d) for w, d in zip(weights, parts) if d is not None]
    if not kept:
        return None
    if megatron and len(kept) < len(parts):
        empty = [p for p, d in zip(prefixes, parts) if d is None]
        raise ValueError(f"data.split={split} leaves no documents of {empty} in part {index} of the blend (0 train, "
                         "1 valid), which Megatron-LM cannot blend either: give that part more weight, or use "
                         "data.blend_rule=megalite, which leaves such a dataset out of the part")
    return BlendedDataset([d for _, d in kept], [w for w, _ in kept], length, cfg.data.blend_rule)


def build_training_data(cfg: Config, rank: int, tokenizer: Tokenizer | None, train_samples: int,
                        valid_samples: int) -> TrainingData:
    d, m = cfg.data, cfg.model
    if d.mock:
        maker = BatchMaker()
        train = MockDataset(m.vocab, m.seq_length, cfg.train.seed)
        return TrainingData(train, MockDataset(m.vocab, m.seq_length, cfg.train.seed, VALIDATION_OFFSET), maker)
    maker = BatchMaker(tokenizer.eod, d.reset_position_ids, d.eod_mask_loss)
    vocab = vocabulary(cfg, tokenizer.vocab_size)
    if d.paths:
        train = _blend(d.paths, d.split, TRAIN, train_samples, cfg, rank, vocab)
        valid = _blend(d.paths, d.split, VALID, valid_samples, cfg, rank, vocab) if valid_samples else None
    else:
        train = _blend(d.train_paths, "1,0,0", TRAIN, train_samples, cfg, rank, vocab)
        valid = (_blend(d.valid_paths, "1,0,0", TRAIN, valid_samples, cfg, rank, vocab)
                 if d.valid_paths and valid_samples else None)
    if train is None:
        raise ValueError(f"data.split={d.split} leaves no training documents in {d.paths}; "
                         "give the train part a weight")
    return TrainingData(train, valid, maker)
