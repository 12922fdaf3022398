"""Model FLOPs and MFU.

Training FLOPs per token = 6 * N + 12 * L * s * (heads * head_dim), where N counts the
weights of every matmul (QKV, attention output, MLP, LM head over the real vocabulary;
not the embedding lookup nor norms) and the second term is the attention scores and
weighted sum (2 matmuls, 2 FLOPs per multiply-add, x3 for forward + backward) counted
over the full s x s square as Megatron-LM and the PaLM paper do. Recompute is not
counted: this is model FLOPs utilisation, not hardware FLOPs.
"""

from __future__ import annotations

import torch

from megalite.config import ModelConfig

# Dense peak TFLOP/s per device (no sparsity), by precision. fp32 is the non-tensor-core rate.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def matmul_parameters(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * d
    proj = cfg.num_attention_heads * d * h
    mlp = h * cfg.ffn_size * (3 if cfg.family == "llama" else 2)
    return cfg.num_layers * (qkv + proj + mlp) + h * cfg.vocab_size


def training_flops_per_token(cfg: ModelConfig) -> float:
    attention = 12 * cfg.num_layers * cfg.seq_length * cfg.num_attention_heads * cfg.head_dim
    return 6 * matmul_parameters(cfg) + attention


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """The device's peak for this precision, or None when unknown (MFU is then reported as n/a)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key].get(precision)
    return None
