"""One-to-one weight mapping between megalite and the Hugging Face architectures of hf_config.py
(GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM, GptOssForCausalLM, DeepseekV3ForCausalLM; Mistral's tensors are Llama's). DeepseekV3's latent
attention is hf_mla.py's; its router's expert bias is HF's `mlp.gate.e_score_correction_bias` (zeros written for a
model without one), its shared expert `mlp.shared_experts`.

Works on full (unsharded) state dicts, in transformers v5's in-memory layout (its save_pretrained writes the
hub's per-expert files from it). Two layout differences are handled here and nowhere else: megalite's fused
QKV is ordered by query group (see model/attention.py) and its vocabulary is padded; GPT-2's HF Conv1D stores
weights transposed. Routed experts need no reshaping: megalite stacks them as v5 does (fc1 = gate_up_proj
[E, 2I, H], gate rows first; fc2 = down_proj [E, H, I]), and the router is HF's `mlp.gate`. Qwen2's q/k/v
biases are ordered by query group as the weights are; Qwen2-MoE's shared expert is a gated MLP like a dense
one, and its gate HF's `mlp.shared_expert_gate`. gpt-oss: q/k/v biases as Qwen2's, o_proj's bias, the sinks
(`self_attn.sinks`), the router with its bias (`mlp.router`), and experts stored as their input multiplies them
(gate_up_proj [E, H, 2I] with gate and up columns interleaved, gate first; down_proj [E, I, H]) with biases: fc1 =
the even then the odd columns, transposed. Whether a model may be converted at all (its features, its routing) is
hf_config.py's check, made here before any tensor moves.
"""

from __future__ import annotations

import torch

from megalite.checkpoint.hf_config import check_hf_features
from megalite.checkpoint.hf_mla import mla_from_hf, mla_to_hf
from megalite.config import ModelConfig

StateDict = dict[str, torch.Tensor]


def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[all q][all k][all v] rows -> [g: q.. k v] rows (weights or biases)."""
    rest = q.shape[1:]
    q, k, v = q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def _ungroup_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest, d = w.shape[1:], cfg.head_size
    per_group = cfg.num_attention_heads // cfg.kv_heads
    w = w.reshape(cfg.kv_heads, (per_group + 2) * d, *rest)
    q, k, v = w.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_vocab(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return torch.cat((w, w.new_zeros(cfg.padded_vocab_size - w.shape[0], *w.shape[1:])))


def _gpt2_layer_names(i: int) -> dict[str, str]:
    """megalite name -> HF name, for the tensors that map without reshaping (Conv1D ones are transposed)."""
    hf, ml = f"transformer.h.{i}.", f"layers.{i}."
    names = {f"{ml}input_norm.{p}": f"{hf}ln_1.{p}" for p in ("weight", "bias")}
    names |= {f"{ml}pre_mlp_norm.{p}": f"{hf}ln_2.{p}" for p in ("weight", "bias")}
    for ours, theirs in (("attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                         ("mlp.linear_fc2", "mlp.c_proj")):
        names |= {f"{ml}{ours}.{p}": f"{hf}{theirs}.{p}" for p in ("weight", "bias")}
    return names


def _llama_layer_names(i: int, cfg: ModelConfig) -> dict[str, str]:
    """Llama, Mixtral, Qwen2(-MoE) and Qwen3(-MoE) layers: the per-head q/k norms (qk_norm), the experts and the
    shared expert's gate map as they are; the fused QKV and the gated MLPs' fused gate/up matrices are split in
    to_hf (the MLPs' down projections are here)."""
    hf, ml = f"model.layers.{i}.", f"layers.{i}."
    names = {
        f"{ml}input_norm.weight": f"{hf}input_layernorm.weight",
        f"{ml}pre_mlp_norm.weight": f"{hf}post_attention_layernorm.weight",
        f"{ml}attention.linear_proj.weight": f"{hf}self_attn.o_proj.weight",
    }
    if cfg.features.bias:
        names[f"{ml}attention.linear_proj.bias"] = f"{hf}self_attn.o_proj.bias"
    if cfg.features.attention_sinks:
        names[f"{ml}attention.sinks"] = f"{hf}self_attn.sinks"
    if cfg.features.qk_norm:
        names |= {f"{ml}attention.{p}_norm.weight": f"{hf}self_attn.{p}_norm.weight" for p in "qk"}
    names |= {f"{ours}linear_fc2.weight": f"{theirs}down_proj.weight" for ours, theirs in _gated_mlps(i, cfg)}
    if not cfg.has_experts(i):
        return names
    if cfg.moe_shared_expert_gate:
        names[f"{ml}mlp.shared_expert_gate"] = f"{hf}mlp.shared_expert_gate.weight"
    if cfg.family == "gpt_oss":  # its experts are reshaped in to_hf / from_hf
        return names | {f"{ml}mlp.router.{p}": f"{hf}mlp.router.{p}" for p in ("weight", "bias")}
    if cfg.moe_expert_bias and cfg.multi_latent_attention:
        names[f"{ml}mlp.router.expert_bias"] = f"{hf}mlp.gate.e_score_correction_bias"
    return names | {f"{ml}mlp.router.weight": f"{hf}mlp.gate.weight",
                    f"{ml}mlp.experts.linear_fc1.weight": f"{hf}mlp.experts.gate_up_proj",
                    f"{ml}mlp.experts.linear_fc2.weight": f"{hf}mlp.experts.down_proj"}


def _gpt_oss_experts_to_hf(state: StateDict, i: int) -> StateDict:
    """megalite's stacked experts of layer i -> gpt-oss's: gate and up interleaved, stored [E, in, out]."""
    ml, hf = f"layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
    gate, up = state[f"{ml}linear_fc1.weight"].chunk(2, dim=1)  # [E, I, H] each
    gate_bias, up_bias = state[f"{ml}linear_fc1.bias"].chunk(2, dim=1)
    return {f"{hf}gate_up_proj": torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2),
            f"{hf}gate_up_proj_bias": torch.stack((gate_bias, up_bias), dim=2).flatten(1, 2),
            f"{hf}down_proj": state[f"{ml}linear_fc2.weight"].transpose(1, 2),
            f"{hf}down_proj_bias": state[f"{ml}linear_fc2.bias"]}


def _gpt_oss_experts_from_hf(hf: StateDict, i: int) -> StateDict:
    ml, theirs = f"layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
    gate_up, bias = hf[f"{theirs}gate_up_proj"], hf[f"{theirs}gate_up_proj_bias"]
    return {f"{ml}linear_fc1.weight": torch.cat((gate_up[:, :, 0::2], gate_up[:, :, 1::2]), dim=2).transpose(1, 2),
            f"{ml}linear_fc1.bias": torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1),
            f"{ml}linear_fc2.weight": hf[f"{theirs}down_proj"].transpose(1, 2),
            f"{ml}linear_fc2.bias": hf[f"{theirs}down_proj_bias"]}


def _gated_mlps(i: int, cfg: ModelConfig) -> list[tuple[str, str]]:
    """(megalite, HF) name prefixes of layer i's gated MLPs: the dense MLP, or a mixture of experts' shared one."""
    ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    if not cfg.has_experts(i):
        return [(ours, theirs)]
    shared = "shared_experts." if cfg.multi_latent_attention else "shared_expert."  # DeepseekV3's plural
    return [(f"{ours}shared_expert.", f"{theirs}{shared}")] if cfg.moe_shared_expert_size else []


def _plain_names(cfg: ModelConfig) -> dict[str, str]:
    """megalite name -> HF name of the tensors outside the layers that map without reshaping."""
    if cfg.family == "gpt2":
        names = {"embedding.position_embeddings.weight": "transformer.wpe.weight"}
        return names | {f"final_norm.{p}": f"transformer.ln_f.{p}" for p in ("weight", "bias")}
    return {"final_norm.weight": "model.norm.weight"}


def _layer_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    return _gpt2_layer_names(i) if cfg.family == "gpt2" else _llama_layer_names(i, cfg)


def _embedding_name(cfg: ModelConfig) -> str:
    return "transformer.wte.weight" if cfg.family == "gpt2" else "model.embed_tokens.weight"


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.startswith("transformer.h.") and hf_name.endswith("weight") and ".ln_" not in hf_name


def to_hf(state: StateDict, cfg: ModelConfig) -> StateDict:
    """megalite full state dict -> HF state dict."""
    check_hf_features(cfg)
    out = {theirs: state[ours] for ours, theirs in _plain_names(cfg).items()}
    out[_embedding_name(cfg)] = state["embedding.word_embeddings.weight"][: cfg.vocab]
    if not cfg.tied:
        out["lm_head.weight"] = state["lm_head.weight"][: cfg.vocab]
    for i in range(cfg.num_layers):
        out |= layer_to_hf(state, cfg, i)
    return {k: v.contiguous() for k, v in out.items()}


def layer_to_hf(state: StateDict, cfg: ModelConfig, i: int) -> StateDict:
    """Layer i's tensors (`layers.{i}.*` in `state`) in HF's names (multi-token prediction's layers too: their
    index continues after num_layers)."""
    names = _layer_names(cfg, i)
    out = {theirs: state[ours].t() if _is_conv1d(theirs) else state[ours] for ours, theirs in names.items()}
    if cfg.multi_latent_attention:
        out |= mla_to_hf(state, cfg, i)
        if cfg.has_experts(i) and not cfg.moe_expert_bias:  # DeepseekV3's router always adds one
            out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.num_experts)
        return out | _gated_mlps_to_hf(state, cfg, i)
    qkv = f"layers.{i}.attention.linear_qkv."
    q, k, v = _ungroup_qkv(state[f"{qkv}weight"], cfg)
    if cfg.family == "gpt2":
        qb, kb, vb = _ungroup_qkv(state[f"{qkv}bias"], cfg)
        return out | {f"transformer.h.{i}.attn.c_attn.weight": torch.cat((q, k, v)).t(),
                      f"transformer.h.{i}.attn.c_attn.bias": torch.cat((qb, kb, vb))}
    attn = f"model.layers.{i}.self_attn."
    out |= {f"{attn}q_proj.weight": q, f"{attn}k_proj.weight": k, f"{attn}v_proj.weight": v}
    if cfg.features.qkv_bias or cfg.features.bias:
        out |= dict(zip((f"{attn}{p}_proj.bias" for p in "qkv"), _ungroup_qkv(state[f"{qkv}bias"], cfg)))
    if cfg.family == "gpt_oss" and cfg.has_experts(i):
        out |= _gpt_oss_experts_to_hf(state, i)
    return out | _gated_mlps_to_hf(state, cfg, i)


def _gated_mlps_to_hf(state: StateDict, cfg: ModelConfig, i: int) -> StateDict:
    out = {}
    for ours, theirs in _gated_mlps(i, cfg):
        gate, up = state[f"{ours}linear_fc1.weight"].chunk(2)
        out |= {f"{theirs}gate_proj.weight": gate, f"{theirs}up_proj.weight": up}
    return out


def from_hf(hf: StateDict, cfg: ModelConfig, rope_interleave: bool = False) -> StateDict:
    """HF state dict -> megalite full state dict (padded vocabulary rows are zero); `rope_interleave`: a
    DeepseekV3 config's, whose rotary rows hf_mla.py permutes."""
    check_hf_features(cfg)
    out = {ours: hf[theirs] for ours, theirs in _plain_names(cfg).items()}
    out["embedding.word_embeddings.weight"] = _pad_vocab(hf[_embedding_name(cfg)], cfg)
    if not cfg.tied:
        out["lm_head.weight"] = _pad_vocab(hf["lm_head.weight"], cfg)
    for i in range(cfg.num_layers):
        out |= layer_from_hf(hf, cfg, i, rope_interleave)
    return {k: v.contiguous() for k, v in out.items()}


def layer_from_hf(hf: StateDict, cfg: ModelConfig, i: int, rope_interleave: bool = False) -> StateDict:
    """Layer i's tensors in megalite's names (`layers.{i}.*`) from HF's (`model.layers.{i}.*`)."""
    names = _layer_names(cfg, i)
    out = {ours: hf[theirs].t() if _is_conv1d(theirs) else hf[theirs] for ours, theirs in names.items()}
    out |= mla_from_hf(hf, cfg, i, rope_interleave) if cfg.multi_latent_attention else _qkv_from_hf(hf, cfg, i)
    if cfg.family == "gpt2":
        return out
    if cfg.family == "gpt_oss" and cfg.has_experts(i):
        out |= _gpt_oss_experts_from_hf(hf, i)
    for ours, theirs in _gated_mlps(i, cfg):
        out[f"{ours}linear_fc1.weight"] = torch.cat([hf[f"{theirs}{p}_proj.weight"] for p in ("gate", "up")])
    return out


def _qkv_from_hf(hf: StateDict, cfg: ModelConfig, i: int) -> StateDict:
    """Layer i's fused QKV weight (and bias), grouped by query group, from GPT-2's c_attn or q/k/v_proj."""
    qkv, out = f"layers.{i}.attention.linear_qkv.", {}
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    if cfg.family == "gpt2":
        w, b = hf[f"transformer.h.{i}.attn.c_attn.weight"].t(), hf[f"transformer.h.{i}.attn.c_attn.bias"]
        return {f"{qkv}weight": _group_qkv(*w.split([q, kv, kv]), cfg.kv_heads),
                f"{qkv}bias": _group_qkv(*b.split([q, kv, kv]), cfg.kv_heads)}
    attn = f"model.layers.{i}.self_attn."
    out[f"{qkv}weight"] = _group_qkv(*(hf[f"{attn}{p}_proj.weight"] for p in "qkv"), cfg.kv_heads)
    if cfg.features.qkv_bias or cfg.features.bias:
        out[f"{qkv}bias"] = _group_qkv(*(hf[f"{attn}{p}_proj.bias"] for p in "qkv"), cfg.kv_heads)
    return out
