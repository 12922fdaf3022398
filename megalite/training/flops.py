"""Model FLOPs and MFU.

Training FLOPs per token = 6 * N + 12 * L * s * (heads * head_dim), where N counts the
weights of every matmul (QKV, attention output, MLP, LM head over the real vocabulary;
not the embedding lookup nor norms) and the second term is the attention scores and
weighted sum (2 matmuls, 2 FLOPs per multiply-add, x3 for forward + backward) counted
over the full s x s square as Megatron-LM and the PaLM paper do; a layer with a sliding window W counts the
pairs its window keeps by the same measure (about 2W keys a token instead of s: `attended_keys`). Recompute is not
counted: this is model FLOPs utilisation (MFU), comparable across recompute settings.

Hardware FLOPs add the forward that activation recompute runs again in backward, as the Megatron-LM
papers count the TFLOP/s they report: full recompute one more forward of every transformer layer (not
the LM head), selective the core attention (softmax(QK^T)V) and here also the experts' second
projection (model/recompute.py). Their utilisation (HFU) says how busy the device was; MFU says how
fast the model trains, comparable across recompute settings. For GPT (MLP 4h, vocabulary V) model
FLOPs per step of B sequences are 72Bslh^2(1 + s/6h + V/12lh), and hardware FLOPs under full
recompute 96Bslh^2(1 + s/6h + V/16lh), the formula of Narayanan et al. 2021. The flash kernel's own
recompute of the scores in backward is counted by neither (nor by Megatron-LM).

A mixture-of-experts layer counts what one token runs through (its active weights): the router
[experts, hidden], the moe_topk experts it is routed to, the shared expert and its gate; not the
experts it skips, which a token costs nothing (as Megatron-LM and torchtitan count MoE MFU).
"""

from __future__ import annotations

import re

import torch

from megalite.config import ModelConfig

# Dense peak TFLOP/s per device model (no sparsity), by precision; fp32 is the non-tensor-core rate.
# Variants of one chip differ (an H100 PCIe has 76% of an SXM's tensor throughput), so MFU keys on the
# exact model, and a device megalite cannot place reads n/a rather than a wrong figure.
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H800 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}
# torch.cuda.get_device_name -> row above; the first match wins ("NVIDIA H100 80GB HBM3" is the SXM
# part, "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" say so; SXM and PCIe A100s share their peaks).
DEVICE_MODELS = (
    (r"\bGH200\b", "GH200"), (r"\bH200 NVL\b", "H200 NVL"), (r"\bH200\b", "H200"),
    (r"\bH100 NVL\b", "H100 NVL"), (r"\bH100 PCIe\b", "H100 PCIe"), (r"\bH100\b.*\b(SXM|HBM3)", "H100 SXM"),
    (r"\bH800 PCIe\b", "H800 PCIe"), (r"\bH800\b", "H800"), (r"\bA100\b", "A100"), (r"\bA800\b", "A800"),
    (r"\bB200\b", "B200"), (r"\bL40S\b", "L40S"), (r"\bA10G\b", "A10G"), (r"\bV100\b", "V100"),
)


def _mlp_weights(cfg: ModelConfig, width: int) -> int:
    """An MLP `width` wide: fc1 (gate and up when gated) and fc2."""
    return cfg.hidden_size * width * (3 if cfg.features.gated_mlp else 2)


def _mlp_matmul_parameters(cfg: ModelConfig, index: int) -> int:
    """Weights one token multiplies in layer `index`'s MLP: the dense MLP's, or a mixture of experts' router,
    top-k experts, shared expert and its gate."""
    if index not in cfg.moe_layers:
        return _mlp_weights(cfg, cfg.ffn_size)
    h, shared = cfg.hidden_size, cfg.moe_shared_expert_size
    gate = h if shared and cfg.moe_shared_expert_gate else 0
    experts = cfg.moe_topk * _mlp_weights(cfg, cfg.expert_ffn_size)
    return cfg.num_experts * h + experts + _mlp_weights(cfg, shared) + gate


def _layer_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights one token multiplies in the transformer layers (what full recompute runs again)."""
    h, d = cfg.hidden_size, cfg.head_size
    qkv = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * d
    proj = cfg.num_attention_heads * d * h
    mlp = sum(_mlp_matmul_parameters(cfg, i) for i in range(cfg.num_layers))
    return cfg.num_layers * (qkv + proj) + mlp


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights one token multiplies (active weights: see the module's docstring), the LM head's included."""
    return _layer_matmul_parameters(cfg) + cfg.hidden_size * cfg.vocab


def attended_keys(cfg: ModelConfig, index: int) -> float:
    """The keys each token's query is counted against in layer `index`: s (the s x s square, twice the causal
    pairs) or, under a sliding window W < s, as many times the pairs the window keeps (sum over queries of
    min(q + 1, W)) as the square counts the causal pairs, 2 pairs / (s + 1): about 2W at long s."""
    s, window = cfg.seq_length, cfg.window(index)
    if window is None or window >= s:
        return s
    return 2 * (window * s - window * (window - 1) / 2) / (s + 1)


def _core_attention_forward_flops(cfg: ModelConfig) -> float:
    """QK^T and the weighted sum over each layer's attended keys, per token: 2 matmuls x 2 FLOPs."""
    keys = sum(attended_keys(cfg, index) for index in range(cfg.num_layers))
    return 4 * keys * cfg.num_attention_heads * cfg.head_size


def training_flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs: forward and backward (twice the forward) of every matmul, nothing recomputed."""
    return 6 * matmul_parameters(cfg) + 3 * _core_attention_forward_flops(cfg)


def recomputed_flops_per_token(cfg: ModelConfig, recompute: str) -> float:
    """The forward FLOPs that train.recompute runs again in backward (model/recompute.py says what reruns)."""
    if recompute == "full":
        return 2 * _layer_matmul_parameters(cfg) + _core_attention_forward_flops(cfg)
    if recompute == "selective":
        moe_layers = len(cfg.moe_layers)
        experts_fc2 = moe_layers * cfg.moe_topk * cfg.expert_ffn_size * cfg.hidden_size
        return _core_attention_forward_flops(cfg) + 2 * experts_fc2
    if recompute == "none":
        return 0.0
    raise ValueError(f"recompute mode {recompute!r} is not one of none, selective, full")


def hardware_flops_per_token(cfg: ModelConfig, recompute: str) -> float:
    """Hardware FLOPs: the model FLOPs plus the recomputed forward (the Megatron-LM papers' TFLOP/s count)."""
    return training_flops_per_token(cfg) + recomputed_flops_per_token(cfg, recompute)


def throughput(tokens_per_sec_per_device: float, cfg: ModelConfig, recompute: str,
               peak: float | None) -> dict[str, float | None]:
    """TFLOP/s per device and its share of the `peak` (None when unknown), by model FLOPs (`tflops_per_device`,
    `mfu`) and by hardware FLOPs (`hardware_tflops_per_device`, `hfu`): the names every report uses."""
    model = tokens_per_sec_per_device * training_flops_per_token(cfg) / 1e12
    hardware = tokens_per_sec_per_device * hardware_flops_per_token(cfg, recompute) / 1e12
    return {"tflops_per_device": model, "mfu": model / peak if peak else None,
            "hardware_tflops_per_device": hardware, "hfu": hardware / peak if peak else None}


def device_model(name: str) -> str | None:
    """The PEAK_TFLOPS row of a CUDA device name, or None when megalite cannot tell the exact model."""
    return next((model for pattern, model in DEVICE_MODELS if re.search(pattern, name, re.IGNORECASE)), None)


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """The device's peak for this precision, or None when unknown (MFU is then reported as n/a)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    model = device_model(torch.cuda.get_device_name(device))
    return PEAK_TFLOPS[model].get(precision) if model else None
