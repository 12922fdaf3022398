"""DeepSeek-V3's multi-token prediction layers as the hub stores them, to and from megalite's MTP depths.

Depth d (from 0) is the hub's layer num_hidden_layers + d (`model.layers.61.*` in DeepSeek-V3), which
transformers' DeepseekV3ForCausalLM does not load: these tensors are read from and written to the safetensors
files directly. Its `enorm`, `hnorm` and `eh_proj` are megalite's (eh_proj's input the embedding half first, as
both lay it out); `shared_head.norm` is megalite's depth `final_norm`; its attention and MoE are a decoder
layer of index num_hidden_layers + d (hf_mapping.layer_to_hf / layer_from_hf, the rotary rows permuted as the
main layers' are), its experts one by one as the hub stores them. `embed_tokens.weight` and
`shared_head.head.weight` are the layer's copies of the shared embedding and output head: written from them,
and on import checked to equal them (megalite's MTP shares both). FP8 weights with block scales
(`weight_scale_inv`) dequantise here as transformers dequantises the main layers' (each FP8 value times its
block's fp32 scale, in fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalite.checkpoint.hf_mapping import layer_from_hf, layer_to_hf
from megalite.config import ModelConfig

StateDict = dict[str, torch.Tensor]
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_norm.weight": "shared_head.norm.weight"}  # megalite's name in mtp.layers.{d}. -> the hub's
_EXPERTS = ".mlp.experts."
MTP_FILE = "model-mtp.safetensors"


def _shared(state: StateDict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The hub layer's copies (its name -> tensor) of the embedding and the output head."""
    embedding = state["embedding.word_embeddings.weight"][: cfg.vocab]
    head = embedding if cfg.tied else state["lm_head.weight"][: cfg.vocab]
    return {"embed_tokens.weight": embedding, "shared_head.head.weight": head}


def mtp_to_hub(state: StateDict, cfg: ModelConfig) -> StateDict:
    """megalite's MTP depths (`mtp.layers.{d}.*` in the full state dict) in the hub's names and layout."""
    out = {}
    for d in range(cfg.mtp_num_layers):
        i, ours, theirs = cfg.num_layers + d, f"mtp.layers.{d}.", f"model.layers.{cfg.num_layers + d}."
        inner = ours + "transformer_layer."
        layer = {f"layers.{i}.{k.removeprefix(inner)}": v for k, v in state.items() if k.startswith(inner)}
        out |= _experts_one_by_one(layer_to_hf(layer, cfg, i))
        out |= {theirs + hub: state[ours + name] for name, hub in _OWN.items()}
        out |= {theirs + name: t for name, t in _shared(state, cfg).items()}
    return {k: v.contiguous() for k, v in out.items()}


def mtp_from_hub(hub: StateDict, main: StateDict, cfg: ModelConfig, rope_interleave: bool, source: str) -> StateDict:
    """The hub's MTP layers (cfg.mtp_num_layers of them, in `hub`) as megalite's depths; `main`: the converted main
    model, whose embedding and head the layers' copies must equal (`source` names the checkpoint in errors)."""
    out = {}
    for d in range(cfg.mtp_num_layers):
        try:
            out |= _depth_from_hub(hub, main, cfg, d, rope_interleave, source)
        except KeyError as missing:
            raise ValueError(f"{source}: its multi-token prediction layer model.layers.{cfg.num_layers + d}.* lacks "
                             f"{missing}; this checkpoint is incomplete and cannot be converted") from None
    return {k: v.float().contiguous() for k, v in out.items()}


def _depth_from_hub(hub: StateDict, main: StateDict, cfg: ModelConfig, d: int, rope_interleave: bool,
                    source: str) -> StateDict:
    i, ours, theirs = cfg.num_layers + d, f"mtp.layers.{d}.", f"model.layers.{cfg.num_layers + d}."
    for name, expected in _shared(main, cfg).items():
        if not torch.equal(hub[theirs + name].float(), expected):
            raise ValueError(f"{source}: {theirs}{name} differs from the main model's, but megalite's multi-token "
                             "prediction shares the embedding and the output head; this model cannot be converted")
    layer = layer_from_hf(_fused_experts(hub, i, cfg), cfg, i, rope_interleave)
    out = {f"{ours}transformer_layer.{k.removeprefix(f'layers.{i}.')}": v for k, v in layer.items()}
    return out | {ours + name: hub[theirs + name_hub] for name, name_hub in _OWN.items()}


def _experts_one_by_one(hf: StateDict) -> StateDict:
    """transformers v5's fused experts (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]) -> the hub's
    `experts.{e}.{gate,up,down}_proj.weight`."""
    out = {}
    for name, t in hf.items():
        prefix, _, kind = name.rpartition(".")
        if _EXPERTS not in name + "." or kind not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e, expert in enumerate(t):
            parts = dict(zip(("gate_proj", "up_proj"), expert.chunk(2))) if kind == "gate_up_proj" else {kind: expert}
            out |= {f"{prefix}.{e}.{part}.weight": w for part, w in parts.items()}
    return out


def _fused_experts(hub: StateDict, i: int, cfg: ModelConfig) -> StateDict:
    """Layer i of the hub's tensors with its experts fused as transformers v5 holds them (the inverse of
    _experts_one_by_one)."""
    experts = f"model.layers.{i}{_EXPERTS}"
    if not cfg.has_experts(i):
        return hub

    def stacked(*kinds: str) -> torch.Tensor:
        return torch.stack([torch.cat([hub[f"{experts}{e}.{kind}.weight"] for kind in kinds])
                            for e in range(cfg.num_experts)])

    return hub | {f"{experts}gate_up_proj": stacked("gate_proj", "up_proj"),
                  f"{experts}down_proj": stacked("down_proj")}


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of `directory` holding it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    return {name: file for file in sorted(directory.glob("*.safetensors")) for name in safe_open(file, "pt").keys()}


def _dequantised(tensors: StateDict, block: tuple[int, int] | None) -> StateDict:
    """`tensors` with each FP8 weight times its 128 x 128 (`block`) scales (`weight_scale_inv`), in fp32."""
    out = {}
    for name, t in tensors.items():
        scale = tensors.get(name.removesuffix("weight") + "weight_scale_inv") if name.endswith(".weight") else None
        if name.endswith("weight_scale_inv"):
            continue
        if scale is not None and block is not None:
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            t = t.float() * full[: t.shape[0], : t.shape[1]]
        out[name] = t
    return out


def _layer_index(name: str) -> int:
    """The layer a `model.layers.{i}.*` tensor belongs to; -1 for the others."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1


def read_hub_mtp(directory: Path, num_layers: int, block: tuple[int, int] | None) -> StateDict:
    """The tensors `directory`'s files hold of layers num_layers and after (the MTP layers, which transformers does
    not load: every one of them, so that none the conversion does not place goes unnoticed), dequantised
    (`block`: the FP8 scales' block size)."""
    files = {name: file for name, file in _weight_files(directory).items() if _layer_index(name) >= num_layers}
    tensors = {}
    for file in set(files.values()):
        with safe_open(file, "pt") as opened:
            tensors |= {name: opened.get_tensor(name) for name in opened.keys() if name in files}
    return _dequantised(tensors, block)


def hub_mtp_depths(hub: StateDict, num_layers: int, declared: int) -> int:
    """How many of the declared MTP layers the checkpoint holds (transformers' own save_pretrained writes none)."""
    return next((d for d in range(declared) if not any(n.startswith(f"model.layers.{num_layers + d}.") for n in hub)),
                declared)


def write_hub_mtp(directory: Path, tensors: StateDict) -> None:
    """Add the MTP layers' tensors to the HF directory written by save_pretrained, in their own file named by the
    weight index (created when save_pretrained wrote one file)."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        single = directory / "model.safetensors"
        main = single.rename(directory / "model-main.safetensors")
        with safe_open(main, "pt") as opened:  # one file: below max_shard_size
            sizes = {name: _bytes(opened.get_tensor(name)) for name in opened.keys()}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict.fromkeys(sizes, main.name)}
    save_file(tensors, directory / MTP_FILE, metadata={"format": "pt"})
    index["weight_map"] |= dict.fromkeys(tensors, MTP_FILE)
    index["metadata"]["total_size"] += sum(_bytes(t) for t in tensors.values())
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
