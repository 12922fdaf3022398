"""The fields DeepSeek-V3-class models (DeepSeek-V3/R1, Kimi K2, Moonlight) add: multi-head latent attention, with
Megatron-LM's names and meanings, and the released group-limited routing's group score; and their checks
(config_validation.py runs them with every other check).

ModelConfig (config.py) inherits these fields, so they read as `model.multi_latent_attention`,
`model.kv_lora_rank`, ... as Megatron-LM's users know them. Megatron's `qk_head_dim` is the part of a query/key
head without RoPE (Hugging Face's `qk_nope_head_dim`; HF's own `qk_head_dim` is nope + rope) and
`qk_pos_emb_head_dim` the rotary part (HF's `qk_rope_head_dim`). YaRN is model.rope_scaling=yarn with its
rope_* fields; under MLA model.rope_mscale_all_dim also scales the softmax (model/latent_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config_sections import documented as _f

if TYPE_CHECKING:
    from megalite.config import Config, ModelConfig


@dataclass
class LatentAttentionFields:
    multi_latent_attention: bool = _f(
        False, "multi-head latent attention (DeepSeek-V2/V3): keys and values come from one compressed latent "
               "per token (kv_lora_rank wide) and a rotary key shared by all heads; queries optionally from a "
               "compressed latent too (q_lora_rank)")
    q_lora_rank: int | None = _f(
        None, "MLA: width of the compressed query latent (DeepSeek-V3: 1536); none: queries projected straight "
              "from the hidden state (DeepSeek-V2-Lite, Moonlight)")
    kv_lora_rank: int = _f(512, "MLA: width of the compressed key/value latent (DeepSeek-V3: 512)")
    qk_head_dim: int = _f(128, "MLA: the part of each query/key head without RoPE (HF's qk_nope_head_dim)")
    qk_pos_emb_head_dim: int = _f(
        64, "MLA: the rotary part of each query/key head (HF's qk_rope_head_dim); the key's is shared by all heads")
    v_head_dim: int = _f(128, "MLA: width of each value head (need not equal the query/key head's)")
    latent_norm_epsilon: float | None = _f(
        None, "MLA: epsilon of the query and key/value latents' RMSNorms (default: model.norm_epsilon, as Megatron-LM; "
              "DeepSeek's code and transformers' use 1e-6 whatever the config's rms_norm_eps: Moonlight's is 1e-5)")
    moe_router_group_experts: int | None = _f(
        None, "group-limited routing: a group's score is the sum of its this-many best experts' scores (released "
              "DeepSeek-V3, Kimi K2 and Moonlight, as transformers computes them: 2; default: moe_topk // "
              "moe_router_group_topk, Megatron-Core's, which agrees only when that is 2)")

    @property
    def latent_epsilon(self) -> float:
        return self.norm_epsilon if self.latent_norm_epsilon is None else self.latent_norm_epsilon

    @property
    def rope_dim(self) -> int:
        """The channels RoPE rotates per head: MLA's rotary part, else the whole head."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_size


def group_score_errors(cfg: Config, world_size: int) -> list[str]:
    """A group's score sums between 1 and all of its experts."""
    m = cfg.model
    if m.moe_router_group_experts is None or not m.num_experts or m.num_experts % max(m.moe_router_groups, 1):
        return []
    per_group = m.num_experts // max(m.moe_router_groups, 1)
    if not 1 <= m.moe_router_group_experts <= per_group:
        return [f"model.moe_router_group_experts={m.moe_router_group_experts} must be between 1 and the experts of a "
                f"group, model.num_experts / model.moe_router_groups = {per_group} (released DeepSeek-V3: 2)"]
    return []


def latent_attention_errors(cfg: Config, world_size: int) -> list[str]:
    """MLA's widths are positive (the rotary part even), it has rotary positions and one key per query head;
    what the MLA layer does not build (model.head_dim, grouped KV heads, q/k norms, biases, windows, sinks) is
    refused naming the field."""
    m = cfg.model
    if not m.multi_latent_attention:
        return []
    errors = [f"model.{name}={getattr(m, name)} must be >= 1" for name in
              ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
              if getattr(m, name) < 1]
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        errors.append(f"model.q_lora_rank={m.q_lora_rank} must be >= 1, or unset for no query compression")
    if m.latent_norm_epsilon is not None and m.latent_norm_epsilon <= 0:
        errors.append(f"model.latent_norm_epsilon={m.latent_norm_epsilon} must be > 0, or unset (model.norm_epsilon)")
    if m.qk_pos_emb_head_dim % 2:
        errors.append(f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim} must be even: RoPE turns channel pairs")
    if m.head_dim is not None:
        errors.append(f"model.head_dim={m.head_dim} has no meaning under model.multi_latent_attention: the head "
                      "widths are model.qk_head_dim (no RoPE) + model.qk_pos_emb_head_dim (RoPE) for queries and "
                      "keys and model.v_head_dim for values; unset model.head_dim")
    refused = {
        "num_query_groups": (m.num_query_groups not in (None, m.num_attention_heads),
                             "every query head has its own key and value, expanded from the shared latent"),
        "position_embedding": (m.features.position_embedding != "rope", "its shared key is rotary; set rope"),
        "qk_norm": (m.features.qk_norm, "its latents have their own norms; set false"),
        "qkv_bias": (m.features.qkv_bias or m.features.bias, "its projections have no biases, as released; set "
                     "model.bias=false and model.qkv_bias=false"),
        "sliding_window": (m.sliding_window is not None, "it attends the whole causal prefix; unset it"),
        "attention_sinks": (m.features.attention_sinks, "it has no sinks; set false"),
    }
    errors += [f"model.{name} is not available with model.multi_latent_attention: {why}"
               for name, (bad, why) in refused.items() if bad]
    return errors


def latent_attention_widths(m: ModelConfig, tp: int) -> list[tuple[int, int, str, int | None]]:
    """The widths MLA's matmuls contract over (config_fp8.py tiles them under blockwise FP8), as (width, the
    tensor-parallel ranks it is split over, the fields that set it, the field's value where one field does):
    the up-projections' inputs, the latents (whole on every rank), and the heads' widths, split over tp: the
    query (up-)projection's output (its input gradient's contraction), the key/value up-projection's (k nope and
    v per head) and the output projection's input (v per head). The key/value down-projection's output,
    kv_lora_rank + qk_pos_emb_head_dim (576 in DeepSeek-V3, 4.5 tiles), is contracted only by its input gradient
    and is whole on every rank: its last tile is padded alike on every layout, as DeepSeek-V3's released block
    scales pad it."""
    heads, qk = "model.num_attention_heads", "(model.qk_head_dim + model.qk_pos_emb_head_dim)"
    widths = [(m.kv_lora_rank, 1, "model.kv_lora_rank", m.kv_lora_rank)]
    if m.q_lora_rank is not None:
        widths.append((m.q_lora_rank, 1, "model.q_lora_rank", m.q_lora_rank))
    n = m.num_attention_heads
    return widths + [
        (n * (m.qk_head_dim + m.qk_pos_emb_head_dim), tp, f"{heads} * {qk}", None),
        (n * (m.qk_head_dim + m.v_head_dim), tp, f"{heads} * (model.qk_head_dim + model.v_head_dim)", None),
        (n * m.v_head_dim, tp, f"{heads} * model.v_head_dim", None),
    ]
