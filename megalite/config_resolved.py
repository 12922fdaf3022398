"""The resolved view of a config: every field the config leaves null, to be derived from others, filled with the
value the run uses (the MLP width, the family's features, the key/value heads, the ZeRO stage, ...).

A checkpoint keeps both: config.yaml as the user gave it, which is what `--config` should be given again (its
nulls are derived afresh, so a new `--model.hidden_size` gets a new MLP width), and resolved.yaml, this view, for
reading and for comparing runs (pinning the derived values, it would keep an old width under a new hidden size).
The start-up dump prints this view. Each value comes from the property that derives it in config.py.
"""

from __future__ import annotations

import copy
import dataclasses

import yaml

from megalite.config import Config, Features

# model fields left null in the config as given -> the ModelConfig property that derives each
_MODEL = {"num_query_groups": "kv_heads", "head_dim": "head_size", "ffn_hidden_size": "ffn_size",
          "max_position_embeddings": "positions"}

RESOLVED_HEADER = ("# The resolved view of config.yaml beside it: derived values filled in, for reading and\n"
                   "# comparing. Pass config.yaml to --config, not this file (it pins the derived widths).\n")


def resolved_config(cfg: Config) -> Config:
    """A copy of `cfg` with every derived default filled in (the MoE expert width only with experts)."""
    out = copy.deepcopy(cfg)
    m = out.model
    for f in dataclasses.fields(Features):
        setattr(m, f.name, getattr(cfg.model.features, f.name))
    for name, derived in _MODEL.items():
        if not (name == "head_dim" and m.multi_latent_attention):  # MLA's heads have their own widths
            setattr(m, name, getattr(cfg.model, derived))
    if m.num_experts:
        m.moe_ffn_hidden_size = cfg.model.expert_ffn_size
    out.parallel.zero_stage = cfg.parallel.zero
    return out


def resolved_yaml(cfg: Config) -> str:
    return yaml.safe_dump(resolved_config(cfg).to_dict(), sort_keys=False)
