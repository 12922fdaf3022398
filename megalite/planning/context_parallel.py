"""Context parallelism in the plan: what attention sends between cp ranks, and the buffers of its backward.

Each cp rank holds seq/cp tokens of every sample (parallel/context_parallel.py), and everything
outside attention is token-local, so activations.py counts every per-token tensor for the local
tokens only. Attention is where the ranks meet, and the two `parallel.cp_comm` choices differ:

- p2p (ring attention) keeps exactly what one device's flash attention keeps, for the local
  queries and keys: nothing here. Its cost is traffic: forward sends the local K/V cp-1 hops;
  backward sends them again, plus the fp32 dK/dV accumulators cp hops (the last one home).
- allgather runs the ring's blocks (same fused kernels, no masks) over the whole sequence's K/V,
  gathered once. With nothing recomputed its autograd Function keeps that gathered K/V for backward
  instead of the local k and v, so nothing keeps those any more: neither k after RoPE nor the fused
  QKV output that v (and, for multi-head attention without RoPE, q and k) is a view of (what attention
  keeps is its own declaration: model/attention.py). Backward builds the whole sequence's dK/dV in fp32
  and casts it to the compute dtype for the reduce-scatter.

Sizes per rank, as in activations.py: K/V groups and heads divided by tp; under sequence parallelism
the attention region still sees all local tokens (seq/cp * micro batch).
"""

from __future__ import annotations

from megalite.config import TORCH_DTYPES, Config
from megalite.planning.built import first_layer, token_rows

COMM_NAMES = {"p2p": "ring attention", "allgather": "all-gather"}


def _sizes(cfg: Config) -> tuple[int, int, int, int]:
    """(local tokens of a micro batch, local query heads, a query head's width, local K/V elements of one layer),
    from the attention of the rank's model (planning/built.py). Latent attention (model/latent_attention.py) runs
    the core on every head's own keys (qk width: nope + rope) and values (v width)."""
    attention = first_layer(cfg).attention
    tokens = token_rows(cfg)[0]
    if hasattr(attention, "kv_rank"):
        query = attention.nope + attention.rope_dim
        return tokens, attention.heads, query, tokens * attention.heads * (query + attention.v_dim)
    return tokens, attention.heads, attention.head_dim, 2 * tokens * attention.groups * attention.head_dim


def comm_bytes(cfg: Config) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer per micro batch for context-parallel attention.

    p2p: forward cp-1 hops of the local K/V; backward cp-1 hops of K/V and cp hops of fp32 dK/dV.
    allgather: a ring all-gather sends cp-1 local K/V blocks; backward's reduce-scatter the same volume
    (dK/dV cast to the compute dtype first). Under recompute (selective or full) backward first reruns
    the attention forward, traffic included."""
    cp = cfg.parallel.cp
    if cp == 1:
        return 0, 0
    width = TORCH_DTYPES[cfg.train.precision].itemsize
    kv = _sizes(cfg)[3]
    forward = (cp - 1) * kv * width
    backward = forward + (cp * kv * 4 if cfg.parallel.cp_comm == "p2p" else 0)
    return forward, backward + (forward if cfg.train.recompute != "none" else 0)


def gathered_kv(cfg: Config) -> int:
    """Elements of one layer's whole-sequence K/V after the all-gather ([cp, 2, b, groups, 2c, d])."""
    return _sizes(cfg)[3] * cfg.parallel.cp


def attention_transient_bytes(cfg: Config, compute: int) -> int:
    """Buffers of one layer's context-parallel attention backward, freed when the layer is done.

    p2p: the K/V block in use and the one arriving, their fp32 dK/dV accumulators, the fp32 dq.
    allgather, as its backward returns: the whole sequence's fp32 dK/dV and the fp32 dq, their casts to
    the compute dtype (none in fp32), and the last block's dK/dV (at most the local K/V); under selective
    recompute also the re-gathered K/V (full recompute counts it in the recomputed layer). Both leave out
    the block kernels' own buffers, as the plan does one device's flash attention backward."""
    p = cfg.parallel
    if p.cp == 1:
        return 0
    tokens, heads, query, kv = _sizes(cfg)
    dq = tokens * heads * query
    if p.cp_comm == "p2p":
        return 2 * kv * (compute + 4) + dq * 4
    cast = compute if compute != 4 else 0  # .to() an fp32 tensor to fp32 returns the tensor itself
    regathered = gathered_kv(cfg) * compute if cfg.train.recompute == "selective" else 0
    return (gathered_kv(cfg) + dq) * (4 + cast) + kv * compute + regathered


def describe(cfg: Config) -> str:
    """The plan's line for context parallelism (printed when cp > 1)."""
    p = cfg.parallel
    forward, backward = comm_bytes(cfg)
    line = (f"context parallel: cp {p.cp}, {COMM_NAMES[p.cp_comm]}, {forward / 2**20:.1f} MiB sent per rank "
            f"per layer per micro batch (forward), {backward / 2**20:.1f} MiB (backward")
    return line + (", attention forward recomputed)" if cfg.train.recompute != "none" else ")")
