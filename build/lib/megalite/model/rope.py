"""Rotary position embeddings in the rotate-half convention Hugging Face Llama uses,
so attention weights map between the two codebases without permuting rows.

With model.rope_scaling=llama3 the frequencies are Llama 3.1's: rotations slower than the original
context's (wavelength > rope_original_max_positions / rope_low_freq_factor) are slowed by
rope_scaling_factor, fast ones (wavelength < .../rope_high_freq_factor) kept, those between blended,
computed step for step as transformers' `_compute_llama3_parameters` does, so the tables are its own.
"""

from __future__ import annotations

import math

import torch

from megalite.config import ModelConfig


def _llama3_scaled(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_positions
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(between, blended, slowed)


def inverse_frequencies(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The rotation speed of each pair of a head's channels, [head_size / 2], fp32."""
    d = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    return _llama3_scaled(inv_freq, cfg) if cfg.rope_scaling == "llama3" else inv_freq


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..cfg.positions-1, each [positions, head_size], in fp32."""
    angles = torch.outer(torch.arange(cfg.positions, dtype=torch.float32, device=device),
                         inverse_frequencies(cfg, device))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rope_for(tables: tuple[torch.Tensor, torch.Tensor], seq: int,
             position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin broadcastable to [seq, batch, heads, head_dim]: positions 0..seq-1, or position_ids [batch, seq]."""
    if position_ids is None:
        return tuple(t[:seq, None, None, :] for t in tables)
    return tuple(t[position_ids.t()].unsqueeze(2) for t in tables)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [seq, batch, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
