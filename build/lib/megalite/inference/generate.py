"""Sampling continuations of prompts from a megalite checkpoint, in one process.

Generation needs no process group and no optimizer: the checkpoint's full tensors (saved at
any parallel layout) are read with model_io and loaded into the one-device model. With the KV
cache (the default) the prompt runs through the model once and every new token once more;
without it each step re-runs the whole sequence, which gives the same tokens and serves as
the reference the cache is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megalite.checkpoint.model_io import read_model_tensors
from megalite.config import Config
from megalite.data.build import tokenizer_from_config
from megalite.data.tokenizers import Tokenizer
from megalite.model.gpt import GPTModel
from megalite.model.kv_cache import KVCache


@dataclass
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (argmax); otherwise the logits are
    divided by the temperature, cut to the top_k most likely tokens and to the smallest set whose
    probability reaches top_p, and sampled."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    use_cache: bool = True
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ValueError(f"need max_new_tokens >= 1 and temperature >= 0, "
                             f"got {self.max_new_tokens} and {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1 (or unset for no cut)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (or unset for no cut)")


def load_model(path: str | Path, device: torch.device) -> tuple[GPTModel, Config, Tokenizer | None]:
    """The one-device model of a checkpoint (root or iter_* directory) in eval mode, its config and
    tokenizer (None when its config names none)."""
    cfg, tensors = read_model_tensors(path)
    model = GPTModel(cfg.model, torch.device("meta"), seed=cfg.train.seed)  # every weight comes from the checkpoint
    model.load_state_dict(tensors, assign=True)
    return model.to(device).eval(), cfg, tokenizer_from_config(cfg.data, cfg.model.vocab_size)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from the logits [vocab] of the last position."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(sampling.top_k).values[-1], float("-inf"))
    if sampling.top_p is not None:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # the probability of the more likely tokens
        logits = logits.index_fill(0, order[before >= sampling.top_p], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], sampling: Sampling) -> list[int]:
    """The new token ids after `prompt`, up to max_new_tokens or through the first stop token."""
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    total = len(prompt) + sampling.max_new_tokens
    if total > model.cfg.positions:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                         f"model's {model.cfg.positions} positions (model.max_position_embeddings); "
                         "shorten one of them")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    cache = KVCache(total) if sampling.use_cache else None
    sequence = torch.tensor([prompt], device=device)
    inputs, new = sequence, []
    while len(new) < sampling.max_new_tokens:
        token = next_token(model(inputs, cache=cache)[0, -1], sampling, generator)
        new.append(token)
        if token in sampling.stop_tokens:
            break
        step = torch.tensor([[token]], device=device)
        sequence = torch.cat((sequence, step), dim=1)
        inputs = step if cache is not None else sequence
    return new
