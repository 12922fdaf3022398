"""Bytes autograd keeps per micro batch, tensor by tensor, as megalite's model stores them.

Why a list and not Korthikanti et al.'s 34*s*b*h closed form: megalite differs in ways that
matter. Attention is SDPA (flash), so no s^2 scores are kept and selective recompute saves
only the logsumexp; q, k and v are views of one fused QKV output; column-parallel layers
under sequence parallelism keep only their local input shard (and gather it again in backward,
parallel/gemm.py); the LM head keeps its [tokens, padded vocab] logits gradient. Every matmul runs
through parallel/gemm.py, which keeps the parameter itself for backward and casts it to the compute
dtype inside the matmul: fp32 parameters under bf16 autocast leave no bf16 weight copies behind (F.linear
under autocast kept one per linear per micro batch in flight, freed only by its backward).
tests/test_plan.py checks these figures against the tensors autograd saves in real CPU runs.

Sizes: s = seq_length, b = micro_batch_size, tokens = s*b/cp (context parallelism gives each rank
seq/cp tokens of every sample, and every term here is per token: flash attention is linear in s);
a tensor inside the tensor-parallel region has its heads / MLP width divided by tp; under sequence
parallelism, norms and the residual stream hold tokens/tp rows. What allgather attention keeps
instead of the local K/V (the whole sequence's): planning/context_parallel.py. What a mixture-of-experts
layer's router, dispatch and experts keep: planning/experts.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import Config
from megalite.model.cross_entropy import chunk_rows
from megalite.parallel.schedules import splits_backward
from megalite.planning.context_parallel import allgather_layer_bytes
from megalite.planning.experts import routed_bytes

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Widths:
    """Bytes per element of each kind of saved tensor, for one precision setup and device type."""

    compute: int  # matmul inputs/outputs, attention (the autocast dtype)
    residual: int  # the residual stream between layers (the parameters' dtype)
    layernorm_input: int  # LayerNorm's saved input: CUDA autocast runs layer_norm in fp32 (a copy)
    layernorm_stats: int  # LayerNorm's mean and rstd
    rmsnorm_input: int  # RMSNorm's saved input per element: CUDA's fused kernel keeps the input as it came (the
    # residual stream's dtype) and an fp32 rstd per row; torch's composite form (CPU) keeps an fp32 x and x * rstd

    @classmethod
    def of(cls, cfg: Config, device: str) -> Widths:
        t = cfg.train
        compute, residual = _BYTES[t.precision], _BYTES[t.param_dtype]
        autocast = t.precision != "fp32"
        on_cuda = device == "cuda"
        return cls(compute, residual, 4 if on_cuda and autocast else residual, 4 if on_cuda else residual,
                   residual if on_cuda else 2 * 4)


def _norm(cfg: Config, rows: int, w: Widths) -> int:
    """LayerNorm keeps input, mean, rstd; RMSNorm its input (Widths.rmsnorm_input) and rstd. Under a schedule
    that splits the backward (zero bubble) either keeps only its input (model/norms.py SplitLayerNorm), on any
    device: its backward runs the norm again."""
    h = cfg.model.hidden_size
    if splits_backward(cfg.parallel.pipeline_schedule):
        return rows * h * w.residual
    if cfg.model.features.norm == "layernorm":
        return rows * (h * w.layernorm_input + 2 * w.layernorm_stats)
    return rows * (h * w.rmsnorm_input + 4)


def token_rows(cfg: Config) -> tuple[int, int]:
    """(this rank's tokens of a micro batch, seq/cp per sample; rows of its residual stream: tokens / tp under SP)."""
    tokens = cfg.model.seq_length // cfg.parallel.cp * cfg.train.micro_batch_size
    return tokens, tokens // cfg.parallel.tp if cfg.parallel.sequence_parallel_active else tokens


def layer_bytes(cfg: Config, device: str = "cuda", index: int = 0) -> int:
    """Transformer layer `index`'s saved tensors (global index: which layers have experts) for one micro batch on
    one rank."""
    m, tp, w = cfg.model, cfg.parallel.tp, Widths.of(cfg, device)
    features = m.features
    tokens, rows = token_rows(cfg)
    if cfg.train.recompute == "full":
        return rows * m.hidden_size * w.residual  # the layer's input, kept by the checkpoint
    h, d, heads, groups = m.hidden_size, m.head_size, m.num_attention_heads // tp, m.kv_heads // tp
    sp = cfg.parallel.sequence_parallel_active
    inputs = rows if sp else tokens  # a column-parallel layer keeps its local input under SP
    attention = (
        inputs * h * w.compute  # QKV input
        + tokens * (heads + 2 * groups) * d * w.compute  # fused QKV output; v (and q, k without RoPE) are views of it
        + (tokens * (heads + groups) * d * w.compute if features.position_embedding == "rope" else 0)  # q, k after RoPE
        + tokens * heads * d * w.compute  # attention output = projection input
        + (tokens * heads * 4 if cfg.train.recompute == "none" else 0)  # flash logsumexp
        + _qk_norm(cfg, tokens, heads, groups, w)
    )
    mlp = moe_block_bytes(cfg, rows, w) if m.is_moe_layer(index) else inputs * h * w.compute + _mlp(cfg, m.ffn_size, w)
    dropout = 2 * rows * h if m.hidden_dropout > 0 else 0  # boolean masks after attention and MLP
    return 2 * _norm(cfg, rows, w) + attention + allgather_layer_bytes(cfg, w.compute) + mlp + dropout


def _qk_norm(cfg: Config, tokens: int, heads: int, groups: int, w: Widths) -> int:
    """Qwen3's per-head RMSNorm of q and k: torch's keeps x * rstd in fp32 and rstd per head, and its input in
    fp32: in fp32 a view of the fused QKV output (counted there) for k, and for q unless grouped-query attention
    made q a copy; in a lower precision an fp32 copy of both."""
    if not cfg.model.features.qk_norm:
        return 0
    rows, d = tokens * (heads + groups), cfg.model.head_size
    if w.compute != 4:
        inputs = rows * d * 4
    else:
        inputs = tokens * heads * d * 4 if groups != heads else 0
    return rows * d * 4 + rows * 4 + inputs


def _mlp(cfg: Config, width: int, w: Widths) -> int:
    """A tensor-parallel MLP `width` wide, past its input: gate|up, silu(gate), product / GELU input and output,
    for all local tokens (column-parallel layers gather them under SP)."""
    intermediates = 4 if cfg.model.features.gated_mlp else 2
    return intermediates * token_rows(cfg)[0] * (width // cfg.parallel.tp) * w.compute


def moe_block_bytes(cfg: Config, rows: int, w: Widths) -> int:
    """A mixture-of-experts block routing this rank's `rows` tokens: the routed part (planning/experts.py), and
    the shared expert, an MLP (gated: times a sigmoid gate, keeping both factors). The router keeps its input
    as fp32; the shared expert's fc1 and gate keep it in the compute dtype: the same tensor when no cast is
    needed (the router's when that is fp32), else a copy each."""
    m = cfg.model
    size = routed_bytes(cfg, rows, w.compute)
    if not m.moe_shared_expert_size:
        return size
    gated = m.moe_shared_expert_gate
    copies = (2 if gated else 1) if w.compute != w.residual else int(w.compute != 4)
    gate = rows * (m.hidden_size + 1) * w.compute if gated else 0
    return size + copies * rows * m.hidden_size * w.compute + _mlp(cfg, m.moe_shared_expert_size, w) + gate


def embedding_bytes(cfg: Config) -> int:
    """The first chunk's embedding: token ids (and, under tp, the out-of-range mask), dropout mask."""
    tokens, rows = token_rows(cfg)
    out_of_range = tokens if cfg.parallel.tp > 1 else 0
    dropout = rows * cfg.model.hidden_size if cfg.model.hidden_dropout > 0 else 0
    return tokens * 8 + out_of_range + dropout


def head_bytes(cfg: Config, device: str = "cuda") -> int:
    """The last chunk's final norm, LM head and loss: one device keeps the [tokens, vocab] logits
    gradient in the compute dtype; vocab-parallel cross-entropy keeps fp32 probabilities."""
    m, tp, w = cfg.model, cfg.parallel.tp, Widths.of(cfg, device)
    tokens, rows = token_rows(cfg)
    head_input = tokens * m.hidden_size * w.compute
    if tp == 1:
        logits = tokens * m.padded_vocab_size * w.compute  # over the padded vocabulary, padding masked
    else:
        logits = tokens * (m.padded_vocab_size // tp * 4 + 8 + 1)  # probabilities, local label ids, ownership mask
    loss = tokens * 8  # per-token losses and the loss mask
    return _norm(cfg, rows, w) + head_input + logits + loss


def head_transient_bytes(cfg: Config, device: str = "cuda") -> int:
    """What the loss holds for a moment beyond the saved activations, on the last chunk. One device turns the
    logits into their gradient a chunk of rows at a time (model/cross_entropy.py): each chunk cast to fp32 and its
    log-softmax, two fp32 copies (one when the logits are fp32), at the accelerators' chunk size (planning is
    for GPUs; a CPU's chunk is a few MiB). Vocab-parallel cross-entropy holds the head's logits in the compute
    dtype beside their fp32 copy (saved), and in backward the gradient's cast back to the compute dtype."""
    m, tp, w = cfg.model, cfg.parallel.tp, Widths.of(cfg, device)
    tokens, _ = token_rows(cfg)
    if tp == 1:
        rows = min(tokens, chunk_rows(m.padded_vocab_size, "cuda"))
        return (1 if w.compute == 4 else 2) * rows * m.padded_vocab_size * 4
    return tokens * (m.padded_vocab_size // tp) * w.compute if w.compute != 4 else 0
