"""One-to-one weight mapping between megalite and Hugging Face GPT2LMHeadModel / LlamaForCausalLM.

Works on full (unsharded) state dicts. Two layout differences are handled here and
nowhere else: megalite's fused QKV is ordered by query group (see model/attention.py)
and its vocabulary is padded; GPT-2's HF Conv1D stores weights transposed. The configs map
both ways too (`hf_config`, `model_config_from_hf`); an HF config describing a network
megalite does not compute (another activation, biases in Llama, RoPE scaling) is refused
rather than converted into a different model, and so is a megalite model whose features
(model.bias, gated_mlp, norm, position_embedding) differ from its family's HF architecture.
The family picks the HF architecture and with it every tensor name below.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.config import FAMILY_FEATURES, ModelConfig

StateDict = dict[str, torch.Tensor]

HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def check_hf_features(cfg: ModelConfig) -> None:
    """Raise ValueError, naming the field, when `cfg` computes something its family's HF class cannot:
    the HF model would silently compute another network. Both classes tie embeddings or not."""
    family = dataclasses.asdict(FAMILY_FEATURES[cfg.family])
    for name, value in dataclasses.asdict(cfg.features).items():
        if name != "tie_embeddings" and value != family[name]:
            raise ValueError(f"model.{name}={str(value).lower()}, but {HF_CLASSES[cfg.family]} "
                             f"(model.family={cfg.family}) computes {name}={str(family[name]).lower()}; "
                             "this model has no Hugging Face equivalent and cannot be converted")


def hf_config(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """The transformers config describing the same network as `cfg` (token ids: its tokenizer's, if any)."""
    from transformers import GPT2Config, LlamaConfig

    check_hf_features(cfg)
    tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if cfg.family == "gpt2":
        return GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.positions, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size, activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tied, **tokens,
        )
    return LlamaConfig(**tokens,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.positions,
        rms_norm_eps=cfg.norm_epsilon, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tied,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
    )


# HF config field -> the value megalite computes; anything else would change the network.
_GPT2_FIXED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
               "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}
_LLAMA_FIXED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)}


def _check_fixed(hf, fixed: dict[str, tuple], source: str) -> None:
    for name, allowed in fixed.items():
        value = getattr(hf, name, allowed[0])
        if value not in allowed:
            raise ValueError(f"{source}: {name}={value!r}, but megalite's {hf.model_type} computes "
                             f"{name}={allowed[0]!r}; this model cannot be converted")


def model_config_from_hf(hf, source: str) -> ModelConfig:
    """The megalite ModelConfig of a transformers GPT2Config or LlamaConfig (`source` names it in errors).

    seq_length is the model's context (max_position_embeddings); override it for training."""
    if hf.model_type == "gpt2":
        _check_fixed(hf, _GPT2_FIXED, source)
        return ModelConfig(
            family="gpt2", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
            ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, seq_length=hf.n_positions,
            max_position_embeddings=hf.n_positions, vocab_size=hf.vocab_size, tie_embeddings=hf.tie_word_embeddings,
            norm_epsilon=hf.layer_norm_epsilon, init_std=hf.initializer_range, hidden_dropout=hf.resid_pdrop,
            attention_dropout=hf.attn_pdrop,
        )
    if hf.model_type != "llama":
        raise ValueError(f"{source}: model_type={hf.model_type!r}; "
                         "megalite converts gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)")
    _check_fixed(hf, _LLAMA_FIXED, source)
    rope = hf.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_parameters.rope_type={rope['rope_type']!r}; "
                         "megalite implements plain RoPE (default) only")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(f"{source}: head_dim={head_dim} x num_attention_heads={hf.num_attention_heads} "
                         f"!= hidden_size={hf.hidden_size}; megalite derives head_dim as hidden_size / heads")
    return ModelConfig(
        family="llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads or hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size, seq_length=hf.max_position_embeddings,
        max_position_embeddings=hf.max_position_embeddings, vocab_size=hf.vocab_size,
        tie_embeddings=hf.tie_word_embeddings, rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_epsilon=hf.rms_norm_eps, init_std=hf.initializer_range, attention_dropout=hf.attention_dropout,
    )


def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[all q][all k][all v] rows -> [g: q.. k v] rows (weights or biases)."""
    rest = q.shape[1:]
    q, k, v = q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def _ungroup_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest, d = w.shape[1:], cfg.head_dim
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


def _llama_layer_names(i: int) -> dict[str, str]:
    hf, ml = f"model.layers.{i}.", f"layers.{i}."
    return {
        f"{ml}input_norm.weight": f"{hf}input_layernorm.weight",
        f"{ml}pre_mlp_norm.weight": f"{hf}post_attention_layernorm.weight",
        f"{ml}attention.linear_proj.weight": f"{hf}self_attn.o_proj.weight",
        f"{ml}mlp.linear_fc2.weight": f"{hf}mlp.down_proj.weight",
    }


def _plain_names(cfg: ModelConfig) -> dict[str, str]:
    if cfg.family == "gpt2":
        names = {"embedding.position_embeddings.weight": "transformer.wpe.weight"}
        names |= {f"final_norm.{p}": f"transformer.ln_f.{p}" for p in ("weight", "bias")}
        for i in range(cfg.num_layers):
            names |= _gpt2_layer_names(i)
        return names
    names = {"final_norm.weight": "model.norm.weight"}
    for i in range(cfg.num_layers):
        names |= _llama_layer_names(i)
    return names


def _embedding_name(cfg: ModelConfig) -> str:
    return "transformer.wte.weight" if cfg.family == "gpt2" else "model.embed_tokens.weight"


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.startswith("transformer.h.") and hf_name.endswith("weight") and ".ln_" not in hf_name


def to_hf(state: StateDict, cfg: ModelConfig) -> StateDict:
    """megalite full state dict -> HF state dict."""
    check_hf_features(cfg)
    out = {}
    for ours, theirs in _plain_names(cfg).items():
        out[theirs] = state[ours].t() if _is_conv1d(theirs) else state[ours]
    out[_embedding_name(cfg)] = state["embedding.word_embeddings.weight"][: cfg.vocab_size]
    if not cfg.tied:
        out["lm_head.weight"] = state["lm_head.weight"][: cfg.vocab_size]
    for i in range(cfg.num_layers):
        q, k, v = _ungroup_qkv(state[f"layers.{i}.attention.linear_qkv.weight"], cfg)
        if cfg.family == "gpt2":
            qb, kb, vb = _ungroup_qkv(state[f"layers.{i}.attention.linear_qkv.bias"], cfg)
            out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat((q, k, v)).t()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat((qb, kb, vb))
        else:
            attn = f"model.layers.{i}.self_attn."
            out |= {f"{attn}q_proj.weight": q, f"{attn}k_proj.weight": k, f"{attn}v_proj.weight": v}
            gate, up = state[f"layers.{i}.mlp.linear_fc1.weight"].chunk(2)
            out |= {f"model.layers.{i}.mlp.gate_proj.weight": gate, f"model.layers.{i}.mlp.up_proj.weight": up}
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: StateDict, cfg: ModelConfig) -> StateDict:
    """HF state dict -> megalite full state dict (padded vocabulary rows are zero)."""
    check_hf_features(cfg)
    out = {}
    for ours, theirs in _plain_names(cfg).items():
        out[ours] = hf[theirs].t() if _is_conv1d(theirs) else hf[theirs]
    out["embedding.word_embeddings.weight"] = _pad_vocab(hf[_embedding_name(cfg)], cfg)
    if not cfg.tied:
        out["lm_head.weight"] = _pad_vocab(hf["lm_head.weight"], cfg)
    h, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        qkv = f"layers.{i}.attention.linear_qkv."
        if cfg.family == "gpt2":
            w, b = hf[f"transformer.h.{i}.attn.c_attn.weight"].t(), hf[f"transformer.h.{i}.attn.c_attn.bias"]
            out[f"{qkv}weight"] = _group_qkv(*w.split([h, kv, kv]), cfg.kv_heads)
            out[f"{qkv}bias"] = _group_qkv(*b.split([h, kv, kv]), cfg.kv_heads)
        else:
            attn = f"model.layers.{i}.self_attn."
            out[f"{qkv}weight"] = _group_qkv(*(hf[f"{attn}{p}_proj.weight"] for p in "qkv"), cfg.kv_heads)
            mlp = f"model.layers.{i}.mlp."
            out[f"layers.{i}.mlp.linear_fc1.weight"] = torch.cat((hf[f"{mlp}gate_proj.weight"],
                                                                  hf[f"{mlp}up_proj.weight"]))
    return {k: v.contiguous() for k, v in out.items()}
