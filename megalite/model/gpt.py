"""The GPT model, written once for both families.

Activations flow as [seq, batch, hidden] (Megatron's order), which keeps the sequence
dimension first for sequence parallelism and pipeline hand-offs. The vocabulary is
padded for divisibility, but the head only scores the real vocabulary, so padded
entries take no probability mass and get no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.config import Config, ModelConfig
from megalite.model.attention import SelfAttention
from megalite.model.cross_entropy import linear_cross_entropy
from megalite.model.init import init_parameters
from megalite.model.mlp import MLP
from megalite.model.norms import build_norm
from megalite.model.rope import rope_for, rope_tables


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, recompute_core: bool) -> None:
        super().__init__()
        self.input_norm = build_norm(cfg.family, cfg.hidden_size, cfg.norm_epsilon, device)
        self.attention = SelfAttention(cfg, recompute_core)
        self.pre_mlp_norm = build_norm(cfg.family, cfg.hidden_size, cfg.norm_epsilon, device)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_norm(x), rope))
        return x + self.dropout(self.mlp(self.pre_mlp_norm(x)))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.positions, cfg.hidden_size) if cfg.family == "gpt2" else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """tokens, position_ids: [batch, seq] -> [seq, batch, hidden]; positions default to 0..seq-1."""
        x = self.word_embeddings(tokens.t())
        if self.position_embeddings is not None:
            if position_ids is None:
                x = x + self.position_embeddings.weight[: tokens.shape[1]].unsqueeze(1)
            else:
                x = x + self.position_embeddings(position_ids.t())
        return self.dropout(x)


class GPTModel(nn.Module):
    def __init__(self, cfg: Config, device: torch.device) -> None:
        super().__init__()
        m = cfg.model
        self.cfg, self.vocab_size = m, m.vocab_size
        self.recompute_full = cfg.train.recompute == "full"
        with torch.device("meta"):
            self.embedding = Embedding(m)
            self.layers = nn.ModuleList(TransformerLayer(m, device, cfg.train.recompute == "selective") for _ in range(m.num_layers))
            self.final_norm = build_norm(m.family, m.hidden_size, m.norm_epsilon, device)
            self.lm_head = None if m.tied else nn.Linear(m.hidden_size, m.padded_vocab_size, bias=False)
        self.to_empty(device=device)
        init_parameters(self, cfg.train.seed, m)
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def output_weight(self) -> torch.Tensor:
        return (self.embedding.word_embeddings if self.lm_head is None else self.lm_head).weight

    def _rope(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.cfg.family != "llama":
            return None
        if tokens.device not in self._rope_cache:
            self._rope_cache[tokens.device] = rope_tables(self.cfg.positions, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        return rope_for(self._rope_cache[tokens.device], tokens.shape[1], position_ids)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token losses [batch, seq] in fp32 when labels are given, else logits [batch, seq, vocab].

        position_ids [batch, seq] restart positions inside a sample (data.reset_position_ids).
        """
        x = self.embedding(tokens, position_ids)
        rope = self._rope(tokens, position_ids)
        for layer in self.layers:
            if self.recompute_full and self.training:
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        x = self.final_norm(x)
        if labels is None:
            return F.linear(x, self.output_weight()[: self.vocab_size]).transpose(0, 1)
        losses = linear_cross_entropy(x.flatten(0, 1), self.output_weight(), labels.t().flatten(), self.vocab_size)
        return losses.view(tokens.shape[1], tokens.shape[0]).t()
