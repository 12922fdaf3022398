"""The architecture features a model is built from, and each model family's: model code reads features, never the
family (config.py's ModelConfig derives a run's features from its family and the fields set)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The MLP nonlinearities: GELU's tanh approximation (GPT-2), exact (erf) GELU (Megatron-LM's default), SiLU, and
# x * sigmoid(1.702 x) (GELU's sigmoid approximation, "quick GELU": gpt-oss's gated experts).
Activation = Literal["gelu_tanh", "gelu", "silu", "quick_gelu"]


@dataclass(frozen=True)
class Features:
    """The architecture choices the model is built from. Model code reads these, never the family,
    so a model that mixes features (a Llama with biases, a GPT-2 with RoPE) needs no new code path."""

    bias: bool
    gated_mlp: bool
    norm: Literal["layernorm", "rmsnorm"]
    position_embedding: Literal["learned", "rope"]
    tie_embeddings: bool
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    qkv_bias: bool = False  # biases on the query/key/value projection even without `bias` (Qwen2)
    activation: Activation = "silu"  # the MLP's nonlinearity; with gated_mlp applied to the gate (SwiGLU: silu)
    attention_sinks: bool = False  # a learned logit per head as one more softmax column with no value (gpt-oss)
    glu_limit: float | None = None  # a gated MLP clamps its gate above and its up projection both sides (gpt-oss: 7)
    glu_linear_offset: float = 0.0  # a gated MLP multiplies by (up + this) (gpt-oss: 1)
    moe_router_bias: bool = False  # the router's linear layer has a bias, added to the logits (gpt-oss)


# Each family's features: the defaults of the ModelConfig fields of the same names.
FAMILY_FEATURES: dict[str, Features] = {
    "gpt2": Features(bias=True, gated_mlp=False, norm="layernorm", position_embedding="learned", tie_embeddings=True,
                     activation="gelu_tanh"),
    "llama": Features(bias=False, gated_mlp=True, norm="rmsnorm", position_embedding="rope", tie_embeddings=False),
    "qwen2": Features(bias=False, gated_mlp=True, norm="rmsnorm", position_embedding="rope", tie_embeddings=False,
                      qkv_bias=True),
    "qwen3": Features(bias=False, gated_mlp=True, norm="rmsnorm", position_embedding="rope", tie_embeddings=False,
                      qk_norm=True),
    "gpt_oss": Features(bias=True, gated_mlp=True, norm="rmsnorm", position_embedding="rope", tie_embeddings=False,
                        activation="quick_gelu", attention_sinks=True, glu_limit=7.0, glu_linear_offset=1.0,
                        moe_router_bias=True),
}

# Per RoPE scaling type, the defaults of model.rope_scaling_factor and model.rope_original_max_positions:
# Llama-3.1's, and gpt-oss's for YaRN.
ROPE_SCALING_DEFAULTS = {"llama3": (8.0, 8192), "yarn": (32.0, 4096)}
