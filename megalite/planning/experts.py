"""Mixture-of-experts layers in the plan: what the dispatcher sends between the expert-parallel ranks, and the
plan's lines.

Each rank routes its own tokens (seq/cp * micro batch, /tp under sequence parallelism: model/moe/layer.py)
to k experts each: k rows per token. The all-to-all dispatcher sends every row to the rank holding its expert
and back; which rank that is depends on the router, so the plan assumes balanced routing (the dispatchers'
`routed_rows`, model/moe/dispatch.py): each rank's experts run tokens*k rows, and (ep-1)/ep of a rank's rows
leave it each way. The all-gather dispatcher gives every rank every row of its expert-parallel group (ep * tokens
* k, those of other ranks' experts masked), and a reduce-scatter brings each token's sum home. What the router,
dispatch, experts and combine keep for backward each declares beside its code (model/costs.py).
"""

from __future__ import annotations

from megalite.config import TORCH_DTYPES, Config
from megalite.parallel.fp8.block_kernel import BLOCK
from megalite.parallel.fp8.grouped_kernel import ALIGN, padded_rows_bound
from megalite.planning.built import moe_block

DISPATCHER_NAMES = {"alltoall": "all-to-all", "allgather": "all-gather"}


def comm_bytes(cfg: Config, tokens: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per mixture-of-experts layer per micro batch for `tokens`
    routed tokens, balanced routing assumed.

    all-to-all: the rows to other ranks' experts, (ep-1)/ep of tokens*k, each way (dispatch and combine), in
    the compute dtype; backward sends their gradients the same way (4 all-to-alls per layer per micro batch).
    all-gather: a ring all-gather sends ep-1 blocks of the tokens (and their fp32 weights and int64 expert
    ids), the combine's reduce-scatter as much back; backward the reverse, weights' gradients included.
    Under full recompute backward reruns the forward, traffic included. The expert counts exchanged before
    each all-to-all (experts x 8 bytes) are left out."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return 0, 0
    width, others = TORCH_DTYPES[cfg.train.precision].itemsize, p.ep - 1
    if p.moe_dispatcher == "alltoall":
        forward = backward = 2 * tokens * m.moe_topk * m.hidden_size * width * others // p.ep
    else:
        hidden = 2 * others * tokens * m.hidden_size * width  # the tokens out, their sums back
        forward = hidden + others * tokens * m.moe_topk * (4 + 8)  # fp32 weights and int64 ids
        backward = hidden + others * tokens * m.moe_topk * 4  # the weights' gradients
    return forward, backward + (forward if cfg.train.recompute == "full" else 0)


def dispatch_calls(cfg: Config, rows: int) -> list[tuple[str, str, int, int]]:
    """(axis, call, calls, bytes per call) of one mixture-of-experts layer per micro batch on a rank routing `rows`
    tokens, each tensor whole as the dry run records it (what leaves the rank: `comm_bytes`), balanced routing
    assumed; full recompute runs each forward call again.

    all-to-all (parallel/expert_parallel.py ExpertAllToAll): over ep, the expert counts (int64 per expert) once
    and the rows (k per token, the compute dtype) to their experts and back, forward and backward; over etp the
    counts and rows of the ranks sharing the experts' matrices gathered, and the partial outputs reduce-scattered,
    both ways. all-gather (ExpertAllGather): over the etp x ep group (axis "ep"), the tokens gathered and their
    sums reduce-scattered both ways, the fp32 combine weights gathered (their gradients scattered back), the
    int64 expert ids gathered."""
    m, p = cfg.model, cfg.parallel
    again = int(cfg.train.recompute == "full")
    tokens = rows * m.hidden_size * TORCH_DTYPES[cfg.train.precision].itemsize
    if p.moe_dispatcher == "allgather":
        n = p.etp * p.ep
        routed = n * rows * m.moe_topk
        return [] if n == 1 else [
            ("ep", "all_gather", 2 + again, n * tokens), ("ep", "reduce_scatter", 2 + again, n * tokens),
            ("ep", "all_gather", 1 + again, routed * 4), ("ep", "reduce_scatter", 1, routed * 4),
            ("ep", "all_gather", 1 + again, routed * 8)]
    counts, routed, calls = m.num_experts * 8, tokens * m.moe_topk, []
    if p.ep > 1:
        calls += [("ep", "all_to_all", 1 + again, counts), ("ep", "all_to_all", 4 + 2 * again, routed)]
    if p.etp > 1:
        calls += [("etp", "all_gather", 1 + again, p.etp * counts), ("etp", "all_gather", 2 + again, p.etp * routed),
                  ("etp", "reduce_scatter", 2 + again, p.etp * routed)]
    return calls


def fp8_row_alignment(cfg: Config) -> int:
    """The multiple an FP8 recipe pads each expert's rows to on CUDA (0: no padding): rowwise for
    torch._scaled_grouped_mm and tensorwise for torch._scaled_mm where an expert's tokens are the contraction, 16;
    blockwise, whole 128-token tiles of its weight gradient (parallel/fp8/grouped_kernel.py, block_kernel.py)."""
    return {"tensorwise": ALIGN, "rowwise": ALIGN, "blockwise": BLOCK}.get(cfg.train.fp8_recipe, 0)


def fp8_padding_rows(cfg: Config, rows: int) -> int:
    """The worst-case rows FP8's expert padding adds to a rank's `rows` routed rows per MoE layer and micro batch:
    at most one alignment block per local expert (an expert's last partial block, or a block of zeros for an
    expert without rows), the fixed bound the padded layout is allocated at. Transient: held for one matmul."""
    align = fp8_row_alignment(cfg)
    return padded_rows_bound(rows, cfg.model.num_experts // cfg.parallel.ep, align) - rows if align else 0


def describe(cfg: Config, tokens: int, layers: int, replicas: int) -> list[str]:
    """The plan's lines for mixture-of-experts layers: `layers` of them, `tokens` routed per rank and micro batch,
    the experts' state sharded over `replicas` (edp) ranks."""
    m, p = cfg.model, cfg.parallel
    local = m.num_experts // p.ep
    shared = f", shared expert {m.moe_shared_expert_size} wide" if m.moe_shared_expert_size else ""
    lines = [f"mixture of experts: {layers} of {m.num_layers} layers, {m.num_experts} experts {m.expert_ffn_size} "
             f"wide, top {m.moe_topk}{shared}; ep {p.ep} x edp {replicas} ({local} expert{'s' if local > 1 else ''} "
             f"per GPU, their gradients reduced over the {replicas} edp ranks)"]
    rows = moe_block(cfg).dispatcher.routed_rows(tokens)
    line = (f"expert dispatch: {DISPATCHER_NAMES[p.moe_dispatcher]}, {rows} rows per GPU per layer per micro batch "
            "(balanced routing)")
    if p.ep > 1:
        forward, backward = comm_bytes(cfg, tokens)
        recomputed = ", layer forward recomputed" if cfg.train.recompute == "full" else ""
        line += (f"; {forward / 2**20:.1f} MiB sent per GPU per layer (forward), "
                 f"{backward / 2**20:.1f} MiB (backward{recomputed})")
    padding = fp8_padding_rows(cfg, rows)
    if padding:
        line += (f"; FP8 ({cfg.train.fp8_recipe}) pads each expert's rows to {fp8_row_alignment(cfg)}: up to "
                 f"{padding} more rows per GPU per layer (worst case, held for one matmul)")
    return [*lines, line]
