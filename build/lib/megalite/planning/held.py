"""What a zero-bubble schedule's B leaves for its W: the inputs of every weight gradient (parallel/weight_grads.py).

After a B the chunk's autograd graph is gone, and with it what the forward saved, except what the queued weight
gradients read: each matmul's input and output gradient (a column-parallel layer's input gathered whole under
sequence parallelism), the LM head's logits gradient and its per-token scaled input, each recomputed layer's
(norm, bias after a reduction) input and output gradient, each lookup's ids and output gradient. Never a
parameter's value. This is held from the B until its W, in place of the chunk's activations; the planner's
schedule walk (planning/memory.py) counts it there. Sizes as in planning/activations.py: tokens = seq/cp x
micro batch, rows = tokens/tp under SP; each closure's tensors are counted on their own, although some share
storage (a layer's output gradient reaches two of them), so this is an upper bound, within a few percent.
"""

from __future__ import annotations

from megalite.config import Config
from megalite.planning.activations import Widths, token_rows
from megalite.planning.experts import routed_rows


def _linear(tokens: int, inputs: int, outputs: int, width: int) -> int:
    """A matmul's input [tokens, inputs] and output gradient [tokens, outputs]."""
    return tokens * (inputs + outputs) * width


def _norm(elements: int, input_width: int, w: Widths) -> int:
    """A recomputed norm's input and output gradient (a norm's output width, planning/activations.py Widths)."""
    return elements * (input_width + w.layernorm_input)


def _mlp(cfg: Config, tokens: int, width: int, w: Widths) -> int:
    h, tp = cfg.model.hidden_size, cfg.parallel.tp
    blocks = 2 if cfg.model.features.gated_mlp else 1
    return _linear(tokens, h, blocks * width // tp, w.compute) + _linear(tokens, width // tp, h, w.compute)


def _experts(cfg: Config, rows: int, w: Widths) -> int:
    """Router (fp32, its input and logits' gradient), the experts' two grouped GEMMs over their routed rows, the
    shared expert and its gate."""
    m, p = cfg.model, cfg.parallel
    h, routed = m.hidden_size, routed_rows(cfg, rows)
    blocks = 2 if m.features.gated_mlp else 1
    width = m.expert_ffn_size // p.etp
    size = _linear(rows, h, m.num_experts, 4)
    size += _linear(routed, h, blocks * width, w.compute) + _linear(routed, width, h, w.compute)
    if m.moe_shared_expert_size:
        size += _mlp(cfg, rows, m.moe_shared_expert_size, w)
        size += _linear(rows, h, 1, w.compute) if m.moe_shared_expert_gate else 0
    return size


def layer_held_bytes(cfg: Config, device: str = "cuda", index: int = 0) -> int:
    """Transformer layer `index`'s weight-gradient inputs for one micro batch on one rank."""
    m, tp, w = cfg.model, cfg.parallel.tp, Widths.of(cfg, device)
    tokens, rows = token_rows(cfg)
    h, d = m.hidden_size, m.head_size
    heads, groups = m.num_attention_heads // tp, m.kv_heads // tp
    size = 2 * _norm(rows * h, w.residual, w)
    size += _linear(tokens, h, (heads + 2 * groups) * d, w.compute) + _linear(tokens, heads * d, h, w.compute)
    size += _norm(tokens * (heads + groups) * d, w.compute, w) if m.features.qk_norm else 0
    size += _experts(cfg, rows, w) if m.is_moe_layer(index) else _mlp(cfg, tokens, m.ffn_size, w)
    if m.features.bias and tp > 1:  # the row-parallel layers' biases, added after the reduction
        size += 2 * 2 * rows * h * w.compute
    return size


def embedding_held_bytes(cfg: Config) -> int:
    """The lookups' ids (int64) and output gradients (the parameters' dtype): the words', the learned positions'."""
    m, w = cfg.model, Widths.of(cfg, "cpu")
    tokens, rows = token_rows(cfg)
    size = tokens * 8 + tokens * m.hidden_size * w.residual
    if m.features.position_embedding == "learned":
        size += rows * 8 + rows * m.hidden_size * w.residual
    return size


def head_held_bytes(cfg: Config, device: str = "cuda") -> int:
    """The final norm's, and the LM head's: on one device the logits gradient (already the head's activation,
    planning/activations.py head_bytes, kept now until W) and the scaled input; vocab-parallel, the gathered
    input and the logits' gradient."""
    m, tp, w = cfg.model, cfg.parallel.tp, Widths.of(cfg, device)
    tokens, rows = token_rows(cfg)
    size = _norm(rows * m.hidden_size, w.residual, w)
    if tp == 1:
        return size + tokens * m.hidden_size * w.compute + tokens * m.padded_vocab_size * w.compute
    return size + _linear(tokens, m.hidden_size, m.padded_vocab_size // tp, w.compute)
