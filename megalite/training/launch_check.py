"""`pretrain_gpt.py --check --nproc-per-node N [--nnodes M] ARGS`: check a launch without starting it.

What a job would find in its first minutes, found on a login node in seconds, before it queues: the config
at the world size the launch gives, the data files (each index read and verified, none empty, no token id
beyond the tokenizer's vocabulary by the largest id preprocessing recorded, one tokenizer per blend), the
tokenizer files and the model's vocabulary they must fit in (training/vocabulary.py), and the checkpoint the
run would resume from (complete, and saved with a model this config can continue). Every problem is reported,
each as a line naming the field or file and the fix. Not checked: what only the job's nodes know (GPUs, memory:
tools/plan.py estimates that), and a checkpoint's tensors (read only by the run itself; the model sections must
agree, which decides their shapes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from megalite.checkpoint.compatibility import check_model
from megalite.checkpoint.files import problem_with
from megalite.checkpoint.local import checkpoint_candidates
from megalite.checkpoint.resume import where_to_resume
from megalite.config import Config
from megalite.config_validation import validate
from megalite.data.blending import parse_blend
from megalite.data.build import check_corpus, vocabulary
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import Tokenizer
from megalite.errors import InvalidInput, UserError
from megalite.training.vocabulary import set_vocabulary


def check_launch(cfg: Config, nproc_per_node: int, nnodes: int, args: list[str]) -> list[str]:
    """The launch's summary lines; raises InvalidInput listing every problem found."""
    cfg, world = copy.deepcopy(cfg), nproc_per_node * nnodes
    lines, problems = [], []

    def attempt(check: Callable[[], str | None]) -> bool:
        try:
            line = check()
        except UserError as error:
            problems.extend(getattr(error, "problems", None) or [str(error)])
            return False
        if line:
            lines.append(line)
        return True

    attempt(lambda: _config(cfg, world))
    tokenizer: list[Tokenizer | None] = []  # _tokenizer's, for _data
    if attempt(lambda: _tokenizer(cfg, tokenizer)):
        attempt(lambda: _data(cfg, tokenizer[0]))
        attempt(lambda: _checkpoint(cfg))
    if problems:
        raise InvalidInput("this launch would fail:\n  - " + "\n  - ".join(problems))
    nodes = f" --nnodes={nnodes} (on every node, with --node-rank or --rdzv-endpoint)" if nnodes > 1 else ""
    return lines + [f"launch: torchrun --nproc-per-node={nproc_per_node}{nodes} pretrain_gpt.py {' '.join(args)}"]


def _config(cfg: Config, world: int) -> str:
    validate(cfg, world, data_files=True)
    p = cfg.parallel
    cp = f", cp {p.cp}" if p.cp > 1 else ""
    return (f"world {world}: tp {p.tp}{cp}, pp {p.pp}, dp {cfg.data_parallel_size(world)}; global batch "
            f"{cfg.batch_size(world)} = {cfg.num_microbatches(world)} micro batches x {cfg.train.micro_batch_size}")


def _tokenizer(cfg: Config, found: list[Tokenizer | None]) -> str:
    tokenizer, source = set_vocabulary(cfg)
    found.append(tokenizer)
    if tokenizer is None:
        return f"data: synthetic tokens below model.vocab_size={cfg.model.vocab_size} ({source})"
    return (f"tokenizer: {vocabulary(cfg, tokenizer.vocab_size).tokenizer}, {tokenizer.vocab_size} ids; "
            f"model.vocab_size={cfg.model.vocab_size} ({source})")


def _data(cfg: Config, tokenizer: Tokenizer | None) -> str | None:
    if tokenizer is None:
        return None
    described = []
    for name in ("paths", "train_paths", "valid_paths"):
        blend = getattr(cfg.data, name)
        if not blend:
            continue
        prefixes = parse_blend(blend)[1]
        check_corpus(prefixes, vocabulary(cfg, tokenizer.vocab_size))
        datasets = [IndexedDataset(prefix) for prefix in prefixes]
        tokens = sum(d.num_tokens for d in datasets)
        described.append(f"data.{name}: {len(datasets)} dataset(s), {sum(map(len, datasets)):,} documents, "
                         f"{tokens:,} tokens")
    return "; ".join(described)


def _checkpoint(cfg: Config) -> str:
    load, note = where_to_resume(cfg.checkpoint)
    candidates = checkpoint_candidates(load)[0] if load else []
    if not candidates:
        return f"checkpoint: none in {load} yet; the run starts from scratch" if load else "checkpoint: none"
    path = Path(candidates[0])
    problem = problem_with(path, checksums=False)
    if problem:
        fallback = "the run falls back to the previous one" if cfg.checkpoint.fallback else "the run stops"
        return f"checkpoint: {problem} ({fallback})"
    changes = check_model(path, cfg.model)
    changed = f", model changes: {', '.join(map(str, changes))}" if changes else ""
    return f"checkpoint: resumes from {path}{changed}" + (f" ({note})" if note else "")
