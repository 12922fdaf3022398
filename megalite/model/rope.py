"""Rotary position embeddings in the rotate-half convention Hugging Face Llama uses,
so attention weights map between the two codebases without permuting rows.

With model.rope_scaling=llama3 the frequencies are Llama 3.1's: rotations slower than the original
context's (wavelength > rope_original_max_positions / rope_low_freq_factor) are slowed by
rope_scaling_factor, fast ones (wavelength < .../rope_high_freq_factor) kept, those between blended,
computed step for step as transformers' `_compute_llama3_parameters` does, so the tables are its own.

With model.rope_scaling=yarn (YaRN, as gpt-oss has it) each frequency is a blend of itself (extrapolated) and
itself / factor (interpolated), by a linear ramp over the channel pairs between those that turn beta_fast and
beta_slow times over the original context (bounds rounded outwards when `truncate`), and cos and sin are scaled by
YaRN's magnitude term: computed step for step as transformers' `_compute_yarn_parameters` does.
"""

from __future__ import annotations

import math

import torch

from megalite.config import ModelConfig
from megalite.model.fused import rope


def _llama3_scaled(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_positions
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(between, blended, slowed)


def _yarn_dimension(rotations: float, d: int, cfg: ModelConfig) -> float:
    """The channel (of d) whose frequency turns `rotations` times over the original context."""
    return d * math.log(cfg.rope_original_positions / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))


def _yarn_scaled(powers: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """`powers`: theta^(2i/d), each pair's wavelength / 2 pi."""
    d = cfg.rope_dim
    low, high = _yarn_dimension(cfg.rope_beta_fast, d, cfg), _yarn_dimension(cfg.rope_beta_slow, d, cfg)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=powers.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (cfg.rope_factor * powers) * (1 - kept) + 1.0 / powers * kept


def mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude term 0.1 m ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_magnitude(cfg: ModelConfig) -> float:
    """YaRN's scale of cos and sin: mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim) when both are
    set, else mscale(factor, 1), with mscale(f, m) = 0.1 m ln f + 1 (1 for f <= 1)."""

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return mscale(cfg.rope_factor)


def inverse_frequencies(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The rotation speed of each pair of a head's rotary channels, [rope_dim / 2], fp32."""
    d = cfg.rope_dim
    powers = cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    if cfg.rope_scaling == "yarn":
        return _yarn_scaled(powers, cfg)
    return _llama3_scaled(1.0 / powers, cfg) if cfg.rope_scaling == "llama3" else 1.0 / powers


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..cfg.positions-1, each [positions, rope_dim], in fp32 (YaRN's scaled)."""
    angles = torch.outer(torch.arange(cfg.positions, dtype=torch.float32, device=device),
                         inverse_frequencies(cfg, device))
    angles = torch.cat((angles, angles), dim=-1)
    if cfg.rope_scaling == "yarn":
        magnitude = yarn_magnitude(cfg)
        return angles.cos() * magnitude, angles.sin() * magnitude
    return angles.cos(), angles.sin()


def rope_for(tables: tuple[torch.Tensor, torch.Tensor], seq: int,
             position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin broadcastable to [seq, batch, heads, head_dim]: positions 0..seq-1, or position_ids [batch, seq]."""
    if position_ids is None:
        return tuple(t[:seq, None, None, :] for t in tables)
    return tuple(t[position_ids.t()].unsqueeze(2) for t in tables)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x: [seq, batch, heads, head_dim]; `fused`: as model/fused.py's one kernel each way."""
    if fused:
        return rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
