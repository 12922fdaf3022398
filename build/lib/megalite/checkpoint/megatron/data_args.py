"""megalite's data section from a Megatron-LM checkpoint's `args`, so that the continued run trains on the samples
Megatron-LM would have read next, and what the converter tells the user about it.

Megatron-LM's pretrain_gpt.py builds its training set with Megatron-Core's BlendedMegatronDatasetBuilder from
the blend (`--data-path`, or `--train-data-path` / `--valid-data-path` per split, or either read from the file
`--data-args-path` / `--per-split-data-args-path` names: training/utils/common_utils.py
get_blend_and_blend_per_split), `--split`, `--seed`, `--seq-length` and `--train-samples` (else train_iters x
global batch) samples, which size each dataset of the blend; its single-pass loader then reads from
`consumed_train_samples` on, as megalite's loader does. `data.blend_rule=megatron` reproduces that builder
(data/megatron_blending.py), so the data section takes the same settings; the tokenizer, `--reset-position-ids`,
`--eod-mask-loss` and `--data-cache-path` carry over by name (megalite's cache files are its own, named apart
from Megatron's).

The paths are those of Megatron's cluster: the report says which to check. What megalite reads differently
(NOT_REPRODUCED, an unweighted blend, another NullTokenizer) is said, never silently changed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalite.checkpoint.megatron.state import arg
from megalite.config import DataConfig
from megalite.data.blending import parse_blend
from megalite.data.megatron_blending import SURPLUS

# Megatron's tokenizer types megalite reads with the same ids, by megalite's name for them (Megatron-Core's
# SentencePiece types without special tokens all give SentencePiece's own ids, eod its eos).
TOKENIZERS = {"GPT2BPETokenizer": "GPT2BPETokenizer", "HuggingFaceTokenizer": "HuggingFaceTokenizer",
              "SentencePieceTokenizer": "SentencePieceTokenizer", "GPTSentencePieceTokenizer": "SentencePieceTokenizer",
              "Llama2Tokenizer": "SentencePieceTokenizer", "NullTokenizer": "NullTokenizer"}
TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")
# Data options whose samples megalite does not reproduce: the value that means "off", and what differs.
NOT_REPRODUCED = {
    "dataloader_type": ("single", "Megatron's cyclic loader reshuffles every epoch; megalite reads the "
                                  "single-pass order"),
    "mid_level_dataset_surplus": (SURPLUS, f"megalite's megatron rule sizes each dataset with a {SURPLUS} surplus"),
    "reset_attention_mask": (False, "megalite's attention crosses documents"),
    "dataloader_inter_document_masking": (False, "megalite's attention crosses documents"),
    "phase_transition_iterations": (None, "megalite reads one blend from start to end"),
    "test_data_path": (None, "megalite has no test split"),
    "fim_data": (False, "megalite has no fill-in-the-middle dataset"),
    "sft": (False, "megalite reads pretraining samples, not Megatron's SFT dataset"),
}


@dataclass
class DataCarry:
    """The data section, and what the converter says: `carried` (field <- argument), `check` (what the user must
    confirm: paths of Megatron's cluster, what differs) and `flags` (what the launch command must add)."""

    data: DataConfig
    carried: list[str] = field(default_factory=list)
    check: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)

    def take(self, name: str, value: Any, source: str) -> None:
        setattr(self.data, name, value)
        self.carried.append(f"data.{name}={value} ({source})")

    def lines(self, consumed: int) -> list[str]:
        """What the converter prints: what was carried, then what to check."""
        out = [f"data carried from Megatron-LM's args (data.blend_rule=megatron: Megatron-Core's blend, so on the same "
               f"corpora the run trains on Megatron's samples {consumed}, {consumed + 1}, ... next):"]
        out += [f"  {line}" for line in self.carried]
        return out + (["check before continuing:"] + [f"  - {line}" for line in self.check] if self.check else [])



def _from_file(carry: DataCarry, path: str, what: str) -> Any:
    """The contents of a blend file Megatron read (json for the per-split one), or None where it is not here."""
    if not Path(path).is_file():
        carry.check.append(f"args.{what}={path} holds the blend and is not here: give its contents as "
                           f"--data.{'paths' if what == 'data_args_path' else 'train_paths / valid_paths'}")
        return None
    text = Path(path).read_text()
    return text.split() if what == "data_args_path" else json.loads(text)


def _take_blend(carry: DataCarry, name: str, items: list[str] | None, source: str) -> bool:
    """Carry one blend list if megalite reads it as Megatron does (weight/prefix pairs or one prefix)."""
    if not items:
        return False
    try:
        parse_blend(items)
    except ValueError as error:
        carry.check.append(f"{source}={items} not carried: {error} (Megatron weighs a list of prefixes by their "
                           f"sizes; megalite needs the weights): give --data.{name} with a weight before each prefix")
        return False
    carry.take(name, [str(item) for item in items], source)
    return True


def _blends(args: argparse.Namespace, carry: DataCarry) -> None:
    if arg(args, "mock_data", False):
        carry.take("mock", True, "args.mock_data")
        return
    single = arg(args, "data_path")
    if arg(args, "data_args_path"):
        single = _from_file(carry, args.data_args_path, "data_args_path")
    per_split = {"train": arg(args, "train_data_path"), "valid": arg(args, "valid_data_path")}
    if arg(args, "per_split_data_args_path"):
        loaded = _from_file(carry, args.per_split_data_args_path, "per_split_data_args_path") or {}
        per_split = {s: loaded[s].split() if isinstance(loaded.get(s), str) else loaded.get(s) for s in per_split}
    if _take_blend(carry, "paths", single, "args.data_path"):
        carry.take("split", args.split, "args.split")
    for split, items in per_split.items():
        _take_blend(carry, f"{split}_paths", items, f"args.{split}_data_path")
    blends = [f"data.{name}" for name in ("paths", "train_paths", "valid_paths") if getattr(carry.data, name)]
    if blends:
        carry.check.append(f"{', '.join(blends)} name Megatron's prefixes: each must be the same .bin/.idx here, "
                           "else override it with the same weights in the same order")
    elif not (arg(args, "data_args_path") or arg(args, "per_split_data_args_path") or single
              or any(per_split.values())):
        carry.flags.append("--data.paths=...")
        carry.check.append("args name no blend: give --data.paths (weights and prefixes as Megatron's --data-path)")


def _null_tokenizer(args: argparse.Namespace, carry: DataCarry) -> None:
    """Megatron's NullTokenizer: before Megatron-Core's tokenizer library (no `null_tokenizer_eod_id` in args)
    ids below vocab_size + 1 with eod vocab_size, megalite's own; since, ids below vocab_size with eod
    null_tokenizer_eod_id (default vocab_size - 1), which megalite's reads when given vocab_size - 1."""
    vocab = args.vocab_size
    if not hasattr(args, "null_tokenizer_eod_id"):
        carry.take("tokenizer_type", "NullTokenizer", "args.tokenizer_type")
        return
    eod = args.null_tokenizer_eod_id if args.null_tokenizer_eod_id is not None else vocab - 1
    carry.flags += ["--data.tokenizer_type=NullTokenizer", f"--model.vocab_size={vocab - 1}"]
    carry.check.append(f"args.tokenizer_type=NullTokenizer (ids below {vocab}, eod {eod}) not carried: megalite's "
                       f"NullTokenizer of model.vocab_size n has ids below n + 1 and eod n, so give "
                       f"--data.tokenizer_type=NullTokenizer --model.vocab_size={vocab - 1} at launch")
    if eod != vocab - 1 and (carry.data.reset_position_ids or carry.data.eod_mask_loss):
        carry.check.append(f"megalite's eod is then {vocab - 1}, not Megatron's {eod}: reset_position_ids and "
                           "eod_mask_loss see other document ends")


def _tokenizer(args: argparse.Namespace, carry: DataCarry) -> None:
    kind = arg(args, "tokenizer_type")
    if kind == "NullTokenizer":
        _null_tokenizer(args, carry)
        return
    if kind not in TOKENIZERS:
        carry.check.append(f"args.tokenizer_type={kind!r} not carried (megalite reads "
                           f"{', '.join(sorted(set(TOKENIZERS.values())))}): give --data.tokenizer_type")
        return
    carry.take("tokenizer_type", TOKENIZERS[kind], "args.tokenizer_type")
    files = [name for name in TOKENIZER_FILES if arg(args, name)]
    for name in files:
        carry.take(name, getattr(args, name), f"args.{name}")
    if files:
        carry.check.append(f"data.{', data.'.join(files)} are Megatron's paths: megalite reads local files only "
                           "(a Hugging Face tokenizer as its directory or tokenizer.json, never a hub name)")
    if arg(args, "special_tokens") or arg(args, "vocab_extra_ids"):
        carry.check.append("args.special_tokens / vocab_extra_ids added tokens to Megatron's tokenizer; megalite's "
                           "has the files' own: model.vocab_size must come out as Megatron's")


def data_from_args(args: argparse.Namespace, train_samples: int) -> DataCarry:
    """The data section of the run a Megatron-LM checkpoint comes from; `train_samples`: the samples megalite's run
    sizes its training blend for (train.train_iters x global batch size)."""
    carry = DataCarry(DataConfig(blend_rule="megatron"))
    for name in ("reset_position_ids", "eod_mask_loss"):
        if arg(args, name, False):
            carry.take(name, True, f"args.{name}")
    if arg(args, "data_cache_path"):
        carry.take("cache_dir", args.data_cache_path, "args.data_cache_path")
        carry.check.append("data.cache_dir is Megatron's: megalite writes its own index files beside Megatron's "
                           "there, so it must be writable here")
    _blends(args, carry)
    _tokenizer(args, carry)
    carry.carried.append(f"train.seed={args.seed} (args.seed: the blend's shuffles)")
    carry.carried.append(f"train.train_iters x train.global_batch_size = {train_samples} samples of model.seq_length="
                         f"{args.seq_length} tokens (the blend's size, from which each dataset is sized: keep them)")
    megatron_samples = arg(args, "train_samples")
    if megatron_samples and megatron_samples != train_samples:
        carry.check.append(f"Megatron sized its blend for args.train_samples={megatron_samples}, megalite for "
                           f"{train_samples} (whole steps): the datasets' sizes, and so the order, differ")
    for name, (off, why) in NOT_REPRODUCED.items():
        if arg(args, name, off) not in (off, None):
            carry.check.append(f"args.{name}={arg(args, name)!r} not reproduced: {why}")
    return carry
