"""Megatron-LM's parameter names and tensor-parallel layouts, and how they map to megalite's.

Megatron's fused QKV rows are ordered by query group ([q heads of the group, k, v] per group), as megalite's
(model/attention.py), and its SwiGLU fc1 is [gate; up] as megalite's, so whole tensors map one-to-one: only
names change. Two sources of names exist for the same norms: the local spec's `input_layernorm` /
`pre_mlp_layernorm` and Transformer Engine's norms fused into the next linear layer
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`; torch_dist always uses these). Sharded over
tensor-parallel ranks (legacy format), column-parallel tensors split their rows, row-parallel ones their
columns; a SwiGLU fc1 shard holds [gate rows of the rank; up rows of the rank].

Multi-latent attention (megatron/core/transformer/multi_latent_attention.py) uses megalite's own names
(model/latent_attention.py); its latent norms are `q_layernorm` / `kv_layernorm` with the local spec and fused
into the up-projections with Transformer Engine's (`linear_q_up_proj.layer_norm_weight`). Its down-projections
are column-parallel with the local spec (split over tp like the up-projections) and duplicated with
Transformer Engine's (whole on every rank): `Sharding` says which. Multi-token prediction's depths are
`mtp.layers.<k>.{enorm,hnorm,eh_proj,final_layernorm}` around one transformer layer
(`mtp.layers.<k>.transformer_layer.*`, `mtp_model_layer.*` as newer modules name it) named as a decoder layer's;
eh_proj is column-parallel and multiplies [embedding; hidden] as megalite's (and DeepSeek's released weights).
The rotary channels' order differs: mla.py.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import torch

from megalite.checkpoint.megatron.state import arg

LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(?:mtp_model_layer|transformer_layer)\.(.+)")
MTP_OWN = re.compile(r"mtp\.layers\.(\d+)\.(enorm\.weight|hnorm\.weight|eh_proj\.weight|final_layernorm\.weight)")

# The tensors of one transformer layer: Megatron's name -> megalite's, within the layer.
LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "input_layernorm.bias": "input_norm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_norm.bias",
    "self_attention.linear_qkv.weight": "attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": "attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": "attention.linear_proj.weight",
    "self_attention.linear_proj.bias": "attention.linear_proj.bias",
    "self_attention.q_layernorm.weight": "attention.q_norm.weight",
    "self_attention.k_layernorm.weight": "attention.k_norm.weight",
    "self_attention.linear_q_proj.weight": "attention.linear_q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.weight": "attention.linear_q_up_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "attention.q_layernorm.weight",
    "self_attention.linear_kv_down_proj.weight": "attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.weight": "attention.linear_kv_up_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "attention.kv_layernorm.weight",
    "self_attention.kv_layernorm.weight": "attention.kv_layernorm.weight",
    "pre_mlp_layernorm.weight": "pre_mlp_norm.weight",
    "pre_mlp_layernorm.bias": "pre_mlp_norm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_norm.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.experts.linear_fc1.weight": "mlp.experts.linear_fc1.weight",  # [experts, out, in]: every expert stacked
    "mlp.experts.linear_fc2.weight": "mlp.experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.linear_fc2.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate",
}
# Under multi-latent attention `q_layernorm` is the query latent's norm, not a per-head q norm.
MLA_NAMES = {"self_attention.q_layernorm.weight": "attention.q_layernorm.weight"}
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "final_layernorm.weight": "final_norm.weight"}
OTHER_NAMES = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "lm_head.weight",
}
# Which dimension tensor parallelism splits (legacy shards): rows of column-parallel layers and of the
# vocabulary, columns of row-parallel layers; everything else (norms, q/k norms over one head's channels,
# row-parallel biases, positions) is copied.
# (An expert's tensors split as a dense MLP's, over expert tensor parallelism, one expert at a time.)
SWIGLU_FC1 = {"mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.experts.linear_fc1.weight",
              "mlp.shared_experts.linear_fc1.weight"}
DOWN_PROJECTIONS = {"self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight"}
COLUMN_PARALLEL = {"self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                   "self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
                   "self_attention.linear_kv_up_proj.weight", "mtp.eh_proj.weight",
                   "embedding.word_embeddings.weight", "output_layer.weight", *SWIGLU_FC1}
ROW_PARALLEL = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.experts.linear_fc2.weight",
                "mlp.shared_experts.linear_fc2.weight"}
# A layer's routed experts, stacked [experts, ...] under one name; the names Megatron saves them under, one
# expert each: the local SequentialMLP's (legacy, experts numbered within the rank), Transformer Engine's
# TEGroupedMLP's (legacy, `weight<e>`), and torch_dist's (both; experts on a dimension of their own).
EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12]\.weight)")
LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)")
GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12]\.weight)(\d+)")
BUFFER = ".mlp.router.expert_bias"  # state, not a parameter: no optimizer state
IGNORED_SUFFIX = "._extra_state"  # Transformer Engine's FP8 metadata (None with the local spec): no weights


@dataclass(frozen=True)
class Sharding:
    """How tensor parallelism split the tensors whose split depends on the run: a SwiGLU fc1 ([gate; up] per
    rank), and MLA's down-projections (column-parallel with the local spec, whole with Transformer Engine's)."""

    swiglu: bool
    split_down_proj: bool = False

    @classmethod
    def of(cls, args: argparse.Namespace) -> Sharding:
        return cls(args.swiglu, arg(args, "transformer_impl", "local") == "local")


def layer_part(name: str) -> tuple[str, str] | None:
    """(the layer's prefix, the name within the layer) of a decoder layer's or a multi-token-prediction
    layer's tensor; None for other tensors."""
    for pattern in (LAYER, MTP_LAYER):
        match = pattern.fullmatch(name)
        if match:
            return name[: match.start(2)], match.group(2)
    return None


def known(name: str, where: str) -> str:
    """The name within its layer (the name itself outside layers; `mtp.<name>` for a prediction depth's own
    tensors) of a tensor megalite has a place for."""
    part, own = layer_part(name), MTP_OWN.fullmatch(name)
    inner = part[1] if part else f"mtp.{own.group(2)}" if own else name
    if inner not in LAYER_NAMES and inner not in OTHER_NAMES and not own:
        raise unknown(name, where)
    return inner


# Tensors of Megatron-LM features megalite does not compute, and what they are.
REFUSED = {
    "self_attention.linear_q_proj.layer_norm_weight": "megatron-core 0.19 under --qk-layernorm without "
    "--q-lora-rank normalises the hidden state once more before linear_q_proj; megalite's MLA, as DeepSeek's, "
    "does not",
    "self_attention.linear_qkv_down_proj.weight": "--mla-down-proj-fusion's fused down-projection",
}


def unknown(name: str, where: str) -> ValueError:
    part = layer_part(name)
    why = REFUSED.get(part[1] if part else name, "a Megatron-LM feature megalite does not compute or does not "
                      "read from Megatron-LM yet")
    return ValueError(f"{where}: tensor {name!r} has no place in megalite's model ({why}); this checkpoint cannot "
                      "be converted")


def megalite_name(name: str, tied: bool, where: str, mla: bool = False) -> str | None:
    """megalite's name of Megatron's (global-layer) `name` (`mla`: the model has multi-latent attention); None
    for the output layer of a tied model, whose weight is the embedding's (Megatron keeps a copy on the last
    pipeline stage)."""
    names = LAYER_NAMES | MLA_NAMES if mla else LAYER_NAMES
    match, mtp, own = LAYER.fullmatch(name), MTP_LAYER.fullmatch(name), MTP_OWN.fullmatch(name)
    if match and match.group(2) in names:
        return f"layers.{match.group(1)}.{names[match.group(2)]}"
    if mtp and mtp.group(2) in names:
        return f"mtp.layers.{mtp.group(1)}.transformer_layer.{names[mtp.group(2)]}"
    if own:
        return f"mtp.layers.{own.group(1)}.{MTP_NAMES[own.group(2)]}"
    if name in OTHER_NAMES:
        return None if tied and name == "output_layer.weight" else OTHER_NAMES[name]
    raise unknown(name, where)


def merge_tensor_parallel(name: str, shards: list[torch.Tensor], sharding: Sharding, where: str) -> torch.Tensor:
    """The whole tensor from its tensor-parallel shards (rank order); stacked experts expert by expert."""
    inner = known(name, where)
    if EXPERT.fullmatch(inner):
        return torch.stack([_merge(inner, list(expert), sharding) for expert in zip(*(s.unbind() for s in shards))])
    return _merge(inner, shards, sharding)


def _column_parallel(inner: str, sharding: Sharding) -> bool:
    return inner in COLUMN_PARALLEL or (sharding.split_down_proj and inner in DOWN_PROJECTIONS)


def _merge(inner: str, shards: list[torch.Tensor], sharding: Sharding) -> torch.Tensor:
    if sharding.swiglu and inner in SWIGLU_FC1:
        gates, ups = zip(*(shard.chunk(2) for shard in shards))
        return torch.cat(gates + ups)
    if _column_parallel(inner, sharding):
        return torch.cat(shards)
    if inner in ROW_PARALLEL:
        return torch.cat(shards, dim=1)
    return shards[0]


def split_tensor_parallel(name: str, tensor: torch.Tensor, size: int, sharding: Sharding) -> list[torch.Tensor]:
    """The tensor-parallel shards of a whole tensor (rank order): merge_tensor_parallel's inverse."""
    inner = known(name, name)
    if EXPERT.fullmatch(inner):
        return [torch.stack(shards) for shards in zip(*(_split(inner, e, size, sharding) for e in tensor.unbind()))]
    return _split(inner, tensor, size, sharding)


def _split(inner: str, tensor: torch.Tensor, size: int, sharding: Sharding) -> list[torch.Tensor]:
    if sharding.swiglu and inner in SWIGLU_FC1:
        gate, up = tensor.chunk(2)
        return [torch.cat(pair) for pair in zip(gate.chunk(size), up.chunk(size))]
    if _column_parallel(inner, sharding):
        return list(tensor.chunk(size))
    if inner in ROW_PARALLEL:
        return list(tensor.chunk(size, dim=1))
    return [tensor] * size


def renumber(name: str, offset: int) -> str:
    """A layer tensor's name with its stage-local layer number made global (`offset` layers before the stage)."""
    match = LAYER.fullmatch(name)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else name


def layer_numbers(names: list[str]) -> set[int]:
    return {int(m.group(1)) for m in map(LAYER.fullmatch, names) if m}
