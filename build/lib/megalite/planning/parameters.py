"""Parameter counts from the config, per tensor-parallel rank of each pipeline stage.

Mirrors how megalite/model builds the GPT: a fused QKV (heads model.head_dim wide; a bias with model.bias or
model.qkv_bias) and (for SwiGLU) a fused gate/up matrix, column-parallel weights and biases split over tp,
row-parallel weights split and their biases replicated, norms (the per-head q/k norms too) and learned
positions replicated, the padded vocabulary split over tp. With tied embeddings under pipeline parallelism
the last stage holds its own copy of the word embeddings as the LM head (kept equal to the first stage's),
which costs memory there.
Each count also lists its ZeRO-3 gather units (GPTModel.chunk_modules): the embedding, each layer,
the final norm and an untied LM head, each gathered whole around its use (parallel/zero/stage3.py).

A mixture-of-experts layer (model/moe/) has, in the MLP's place, a router [experts, hidden] (dense grid,
replicated), every expert's two projections stacked (the expert grid: each rank holds num_experts/ep of
them, whole, as their placement says) and optionally a shared expert (a tensor-parallel MLP) with its gate
[1, hidden]. The counts keep the two grids apart (`Parameters.by_grid`), as gradients are reduced and
optimizer state sharded over each grid's own data axes (planning/memory.py).
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
    expert: int = 0  # on the expert grid: this rank's experts' weights (num_experts/ep experts of each layer)
    largest: int = 0  # elements of the largest single parameter (its gradient is briefly materialised)
    units: tuple[int, ...] = ()  # elements of each gather unit with parameters of its own, in forward order
    tied_head: bool = False  # the LM head reads the word embeddings of this rank's embedding unit (units[0])

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.expert

    @property
    def by_grid(self) -> dict[str, int]:
        """Elements on each rank grid (parallel/placement.py `Placement.grid`)."""
        return {"dense": self.sharded + self.replicated, "expert": self.expert}

    def __add__(self, other: Parameters) -> Parameters:
        return Parameters(self.sharded + other.sharded, self.replicated + other.replicated,
                          self.expert + other.expert, max(self.largest, other.largest), self.units + other.units,
                          self.tied_head or other.tied_head)


def _params(tp: int, sharded: list[int], replicated: list[int], expert: tuple[int, ...] = ()) -> Parameters:
    """One gather unit's parameters; `expert` are already this rank's (split over ep)."""
    split = [n // tp for n in sharded]
    local = split + replicated + list(expert)
    return Parameters(sum(split), sum(replicated), sum(expert), max(local, default=0), (sum(local),))


def _mlp(m: ModelConfig, width: int) -> tuple[list[int], list[int]]:
    """(tensor-parallel-split, replicated) elements of an MLP `width` wide: fc1 (gate and up when gated) and
    its bias split, fc2 split and its bias replicated."""
    h, fc1 = m.hidden_size, (2 if m.features.gated_mlp else 1) * width
    bias = m.features.bias
    return [h * fc1, width * h] + ([fc1] if bias else []), [h] if bias else []


def expert_parameters(m: ModelConfig) -> int:
    """One routed expert's weights (fc1, gate and up when gated, and fc2; no biases)."""
    return (3 if m.features.gated_mlp else 2) * m.hidden_size * m.expert_ffn_size


def _moe(m: ModelConfig, ep: int) -> tuple[list[int], list[int], tuple[int, ...]]:
    """(tensor-parallel-split, replicated, expert-grid) elements of a mixture-of-experts block: the router,
    num_experts/ep experts' stacked projections, the shared expert and its gate."""
    h, width, local = m.hidden_size, m.expert_ffn_size, m.num_experts // ep
    fc1 = (2 if m.features.gated_mlp else 1) * width
    sharded, replicated = _mlp(m, m.moe_shared_expert_size) if m.moe_shared_expert_size else ([], [])
    gate = [h] if m.moe_shared_expert_size and m.moe_shared_expert_gate else []
    return sharded, [m.num_experts * h, *replicated, *gate], (local * fc1 * h, local * h * width)


def layer_parameters(m: ModelConfig, tp: int = 1, index: int = 0, ep: int = 1) -> Parameters:
    """Transformer layer `index` (global: which layers have experts) on one tensor- and expert-parallel rank."""
    h, d, bias = m.hidden_size, m.head_size, m.features.bias
    qkv = (m.num_attention_heads + 2 * m.kv_heads) * d
    norm = _norm_parameters(m)
    sharded = [h * qkv, m.num_attention_heads * d * h] + ([qkv] if bias or m.features.qkv_bias else [])
    replicated = [norm, norm] + ([h] if bias else []) + ([d, d] if m.features.qk_norm else [])
    expert: tuple[int, ...] = ()
    if m.is_moe_layer(index):
        mlp_sharded, mlp_replicated, expert = _moe(m, ep)
    else:
        mlp_sharded, mlp_replicated = _mlp(m, m.ffn_size)
    return _params(tp, sharded + mlp_sharded, replicated + mlp_replicated, expert)


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
    """What one tensor- and expert-parallel rank of pipeline stage `pp_rank` holds (same for every such rank)."""
    m, (tp, ep), stage = cfg.model, (cfg.parallel.tp, cfg.parallel.ep), stage_layout(cfg, pp_rank)
    total = embedding_parameters(m, tp) if stage.has_embedding else Parameters()
    for a, b in stage.chunks:
        for index in range(a, b):
            total = total + layer_parameters(m, tp, index, ep)
    tied_head = m.tied and stage.shares_embedding
    if stage.has_head:
        total = total + head_parameters(m, tp, with_output_layer=not tied_head)
    return replace(total, tied_head=tied_head)


def model_parameters(m: ModelConfig) -> int:
    """The one-device model's parameter count (padded vocabulary; a tied head counted once)."""
    layers = sum(layer_parameters(m, index=i).total for i in range(m.num_layers))
    return layers + embedding_parameters(m).total + head_parameters(m, with_output_layer=not m.tied).total


def moe_layers(m: ModelConfig) -> int:
    """How many layers have routed experts."""
    return sum(m.is_moe_layer(i) for i in range(m.num_layers))


def active_parameters(m: ModelConfig) -> int:
    """The parameters one token uses: the model less, in each mixture-of-experts layer, the experts it is not
    routed to (num_experts - moe_topk of them); the dense parts, router and shared expert all count."""
    return model_parameters(m) - moe_layers(m) * (m.num_experts - m.moe_topk) * expert_parameters(m)


def vocabulary_padding(m: ModelConfig) -> int:
    """Parameters added by padding the vocabulary (twice when the head is untied)."""
    return (m.padded_vocab_size - m.vocab_size) * m.hidden_size * (1 if m.tied else 2)
