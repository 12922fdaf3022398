"""Rotary position embeddings in the rotate-half convention Hugging Face Llama uses,
so attention weights map between the two codebases without permuting rows."""

from __future__ import annotations

import torch


def rope_tables(positions: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..positions-1, each [positions, head_dim], in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32, device=device), inv_freq)
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
