"""Parameter counts from the config, per tensor-parallel rank of each pipeline stage.

Mirrors how megalite/model builds the GPT: a fused QKV and (for SwiGLU) a fused gate/up matrix,
column-parallel weights and biases split over tp, row-parallel weights split and their biases
replicated, norms (the per-head q/k norms too) and learned positions replicated, the padded
vocabulary split over tp. With tied embeddings under pipeline parallelism the last stage holds its
own copy of the word embeddings as the LM head (kept equal to the first stage's), which costs
memory there.
Each count also lists its ZeRO-3 gather units (GPTModel.chunk_modules): the embedding, each layer,
the final norm and an untied LM head, each gathered whole around its use (parallel/zero/stage3.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megalite.config import Config, ModelConfig
from megalite.parallel.pipeline_layout import stage_layout


@dataclass(frozen=True)
class Parameters:
    """Element counts held by one rank: split over tp (`sharded`, already divided) or replicated."""

    sharded: int = 0
    replicated: int = 0
    largest: int = 0  # elements of the largest single parameter (its gradient is briefly materialised)
    units: tuple[int, ...] = ()  # elements of each gather unit with parameters of its own, in forward order
    tied_head: bool = False  # the LM head reads the word embeddings of this rank's embedding unit (units[0])

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def __add__(self, other: Parameters) -> Parameters:
        return Parameters(self.sharded + other.sharded, self.replicated + other.replicated,
                          max(self.largest, other.largest), self.units + other.units,
                          self.tied_head or other.tied_head)


def _params(tp: int, sharded: list[int], replicated: list[int]) -> Parameters:
    """One gather unit's parameters."""
    local = [n // tp for n in sharded]
    return Parameters(sum(local), sum(replicated), max(local + replicated, default=0), (sum(local + replicated),))


def layer_parameters(m: ModelConfig, tp: int = 1) -> Parameters:
    """One transformer layer on one tensor-parallel rank."""
    h, d, bias = m.hidden_size, m.head_dim, m.features.bias
    qkv = (m.num_attention_heads + 2 * m.kv_heads) * d
    fc1 = (2 if m.features.gated_mlp else 1) * m.ffn_size
    norm = _norm_parameters(m)
    sharded = [h * qkv, m.num_attention_heads * d * h, h * fc1, m.ffn_size * h] + ([qkv, fc1] if bias else [])
    replicated = [norm, norm] + ([h, h] if bias else []) + ([d, d] if m.features.qk_norm else [])
    return _params(tp, sharded, replicated)


def _norm_parameters(m: ModelConfig) -> int:
    """LayerNorm has a weight and a bias (whatever model.bias says), RMSNorm a weight."""
    return 2 * m.hidden_size if m.features.norm == "layernorm" else m.hidden_size


def embedding_parameters(m: ModelConfig, tp: int = 1) -> Parameters:
    positions = [m.positions * m.hidden_size] if m.features.position_embedding == "learned" else []
    return _params(tp, [m.padded_vocab_size * m.hidden_size], positions)


def head_parameters(m: ModelConfig, tp: int = 1, with_output_layer: bool = True) -> Parameters:
    """The final norm, and the LM head unless it is the (tied) word embedding on the same rank: two units."""
    norm = _params(tp, [], [_norm_parameters(m)])
    return norm + _params(tp, [m.padded_vocab_size * m.hidden_size], []) if with_output_layer else norm


def rank_parameters(cfg: Config, pp_rank: int) -> Parameters:
    """What one tensor-parallel rank of pipeline stage `pp_rank` holds (same for every tp rank)."""
    m, tp, stage = cfg.model, cfg.parallel.tp, stage_layout(cfg, pp_rank)
    total = embedding_parameters(m, tp) if stage.has_embedding else Parameters()
    for a, b in stage.chunks:
        for _ in range(a, b):
            total = total + layer_parameters(m, tp)
    tied_head = m.tied and stage.has_embedding and stage.has_head
    if stage.has_head:
        total = total + head_parameters(m, tp, with_output_layer=not tied_head)
    return replace(total, tied_head=tied_head)


def model_parameters(m: ModelConfig) -> int:
    """The one-device model's parameter count (padded vocabulary; a tied head counted once)."""
    layers = m.num_layers * layer_parameters(m).total
    return layers + embedding_parameters(m).total + head_parameters(m, with_output_layer=not m.tied).total


def vocabulary_padding(m: ModelConfig) -> int:
    """Parameters added by padding the vocabulary (twice when the head is untied)."""
    return (m.padded_vocab_size - m.vocab_size) * m.hidden_size * (1 if m.tied else 2)
