"""Whether a checkpoint fits the model a run builds, before a byte of it is loaded.

A checkpoint holds global tensors by name, and any layout reads them. Names alone let the wrong model
through: a 4-layer checkpoint resumed with `model.num_layers=2` holds every tensor the smaller model
asks for, and two layers would be dropped without a word. So a resume compares the model section of
the checkpoint's config.yaml with the run's, field by field on the values the model is built from (a
width left to its default is compared as the width it derives), and refuses a difference in anything
that fixes the shapes or the meaning of the weights (layers, widths, heads, groups, vocabulary,
experts and their routing, the family and its features). The fields in CHANGEABLE may differ: context
extension (sequence length, RoPE base and scaling; the rows of a learned position table excepted),
dropouts, balancing coefficients, capacity, the expert bias's rate, the norm epsilon, the init; the run
logs each change. Then the tensors are compared by name and shape: none missing, none left over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from megalite.config import Config, Features, ModelConfig
from megalite.config_cli import set_field
from megalite.errors import InvalidInput

CHANGEABLE = frozenset({
    "seq_length", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions", "norm_epsilon",
    "latent_norm_epsilon", "init_std",
    "hidden_dropout", "attention_dropout", "moe_aux_loss_coeff", "moe_seq_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_bias_update_rate", "moe_capacity_factor", "moe_drop_policy", "moe_pad_to_capacity",
})

_FEATURE_NAMES = {f.name for f in dataclasses.fields(Features)}
# Fields compared on the value the model is built from, not on what was written (None: "the default").
_RESOLVED: dict[str, Callable[[ModelConfig], Any]] = {
    "num_query_groups": lambda m: m.kv_heads,
    "head_dim": lambda m: m.head_size,
    "ffn_hidden_size": lambda m: m.ffn_size,
    "moe_ffn_hidden_size": lambda m: m.expert_ffn_size,
    "max_position_embeddings": lambda m: m.positions,
    "vocab_size": lambda m: m.vocab,
    "make_vocab_size_divisible_by": lambda m: m.padded_vocab_size,
    "moe_router_group_topk": lambda m: m.moe_router_group_topk or m.moe_router_groups,
    "moe_router_group_experts": lambda m: m.moe_router_group_experts or m.moe_topk // (m.moe_router_group_topk
                                                                                      or m.moe_router_groups),
    **{name: (lambda m, name=name: getattr(m.features, name)) for name in _FEATURE_NAMES},
}
# What a default follows: the fields it is derived from (config.py's ModelConfig properties).
_DERIVED_FROM: dict[str, set[str]] = {
    "num_query_groups": {"num_attention_heads"},
    "head_dim": {"hidden_size", "num_attention_heads"},
    "ffn_hidden_size": {"hidden_size", "family", "gated_mlp"},
    "moe_ffn_hidden_size": {"hidden_size", "family", "gated_mlp", "ffn_hidden_size"},
    "moe_router_group_topk": {"moe_router_groups"},
    "moe_router_group_experts": {"moe_topk", "moe_router_group_topk", "moe_router_groups"},
    "make_vocab_size_divisible_by": {"vocab_size"},  # compared as the padded vocabulary
    **{name: {"family"} for name in _FEATURE_NAMES},
}
_HINTS = {"vocab_size": "leave model.vocab_size unset to keep the checkpoint's, with a tokenizer whose ids fit in it",
          "make_vocab_size_divisible_by": "it pads the vocabulary"}


@dataclasses.dataclass(frozen=True)
class Change:
    field: str
    saved: Any
    current: Any

    @property
    def what(self) -> str:
        return "the padded vocabulary" if self.field == "make_vocab_size_divisible_by" else f"model.{self.field}"

    def __str__(self) -> str:
        return f"{self.what} {self.saved} -> {self.current}"

    def refusal(self) -> str:
        hint = f" ({_HINTS[self.field]})" if self.field in _HINTS else ""
        return f"{self.what}={self.saved} in the checkpoint, {self.current} here{hint}"


class CheckpointMismatch(InvalidInput):
    """A checkpoint saved with another model than the one this run builds."""


def saved_model(path: Path) -> ModelConfig:
    """The model section of checkpoint `path`'s config.yaml; fields this version does not know are left out
    (a newer megalite's), fields it lacks keep their defaults (an older one's)."""
    saved = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("model") or {}
    cfg = Config()
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for name, value in saved.items():
        if name in known:
            set_field(cfg, f"model.{name}", value, f"{path / 'config.yaml'}")
    return cfg.model


def model_changes(saved: ModelConfig, current: ModelConfig) -> tuple[list[Change], list[Change]]:
    """(refused, allowed) differences between a checkpoint's model and the run's. A width both configs leave to
    its default is not listed when what it derives from is (it follows), nor are the experts' fields of two
    models without experts."""
    refused, allowed = [], []
    rope = current.features.position_embedding == "rope" == saved.features.position_embedding
    experts = saved.num_experts or current.num_experts
    for f in dataclasses.fields(ModelConfig):
        value = _RESOLVED.get(f.name, lambda m, name=f.name: getattr(m, name))
        before, after = value(saved), value(current)
        if before == after or (f.name.startswith("moe_") and not experts):
            continue
        changeable = f.name in CHANGEABLE and (rope or f.name != "max_position_embeddings")
        (allowed if changeable else refused).append(Change(f.name, before, after))
    named = {c.field for c in refused}
    return [c for c in refused if not _follows(c, saved, current, named)], allowed


def _follows(change: Change, saved: ModelConfig, current: ModelConfig, named: set[str]) -> bool:
    """Whether `change` is only the consequence of a listed one: a default derived on both sides (the padded
    vocabulary always) from a field that changed."""
    name = change.field
    derived = name == "make_vocab_size_divisible_by" or getattr(saved, name) is None and getattr(current, name) is None
    return derived and bool(named & _DERIVED_FROM.get(name, set()))


def _names(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_fits(path: Path, saved_shapes: dict[str, list[int]], held_shapes: dict[str, list[int]],
               model_names: set[str] | None, model: ModelConfig | None) -> None:
    """Refuse checkpoint `path` if `model` (the run's) differs from its saved one where weights cannot follow, or
    its tensors (`saved_shapes`) do not match this rank's (`held_shapes`) and the whole model's (`model_names`;
    None: not checked). One line names the fields with both values, a few tensors and the fix."""
    refused = model_changes(saved_model(path), model)[0] if model is not None else []
    wrong = {name: (saved_shapes[name], shape) for name, shape in held_shapes.items()
             if name in saved_shapes and list(saved_shapes[name]) != list(shape)}
    missing = held_shapes.keys() - saved_shapes.keys()
    unexpected = saved_shapes.keys() - model_names if model_names is not None else set()
    if not (refused or wrong or missing or unexpected):
        return
    problems = []
    if refused:
        problems.append("; ".join(c.refusal() for c in refused))
    tensors = []
    if wrong:
        first, *others = sorted(wrong)
        also = f"; also {_names(others)}" if others else ""
        tensors.append(f"{len(wrong)} of other shapes ({first}: {tuple(wrong[first][0])} in the checkpoint, "
                       f"{tuple(wrong[first][1])} here{also})")
    if missing:
        tensors.append(f"{len(missing)} missing ({_names(missing)})")
    if unexpected:
        tensors.append(f"{len(unexpected)} this model has no place for ({_names(unexpected)})")
    if tensors:
        problems.append("tensors: " + ", ".join(tensors))
    flags = " ".join(f"--model.{c.field}={c.saved}" for c in refused if c.field not in _HINTS)
    fix = (f"resume with the checkpoint's model ({flags})" if flags else "resume with the checkpoint's model config")
    raise CheckpointMismatch(f"checkpoint {path} does not fit this model (saved with another model config): "
                             f"{'; '.join(problems)}. Fix: {fix}, or give this model its own checkpoint.save "
                             "directory (and no checkpoint.load) to start a new run")


def check_model(path: Path, model: ModelConfig) -> list[Change]:
    """Refuse checkpoint `path` when `model` differs from its saved one where the weights cannot follow (the
    tensors are not read); returns the allowed changes."""
    check_fits(path, {}, {}, None, model)
    return model_changes(saved_model(path), model)[1]
