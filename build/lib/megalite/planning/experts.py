"""Mixture-of-experts layers in the plan: what the routed part of one keeps for backward, and what its
dispatcher sends between the expert-parallel ranks.

Each rank routes its own tokens (seq/cp * micro batch, /tp under sequence parallelism: model/moe/layer.py)
to k experts each: k rows per token. The all-to-all dispatcher sends every row to the rank holding its expert
and back; which rank that is depends on the router, so the plan assumes balanced routing: each rank's experts
run tokens*k rows, and (ep-1)/ep of a rank's rows leave it each way. The all-gather dispatcher gives every
rank every row of its expert-parallel group (ep * tokens * k, those of other ranks' experts masked), and a
reduce-scatter brings each token's sum home.

What autograd keeps per micro batch (model/moe/router.py, dispatch.py, experts.py; checked against the
saved tensors in tests/test_plan.py), for T routed tokens and R rows:
- router (fp32): its input as fp32 [T, hidden] (a copy unless the parameters are fp32; its matmul runs through
  parallel/gemm.py, which casts the weight inside and keeps the parameter), the scores [T, experts], the
  chosen ids [T, k] (int64), the chosen scores and their sums when renormalised, the logits and their
  logsumexp with the z-loss on;
- sorting: the expert order and each row's token (int64 per row of the rank's own tokens), and with
  ep > 1 the regrouping of the received rows and its inverse (all-to-all) or the mask of this rank's rows
  (all-gather);
- the experts: the rows in [R, hidden], fc1's output, the SwiGLU / GELU intermediates (4 or 2 tensors
  [R, expert width], as a dense MLP's), in the compute dtype (the grouped GEMM casts fp32 weights inside its
  autograd function and keeps the parameter, as gemm.py does, so no compute-dtype copy of them);
- the combine, in fp32: each returning row as fp32, its weighted copy (index_add keeps its source), the
  rows' combine weights.
The shared expert is a dense MLP: planning/activations.py counts it.
"""

from __future__ import annotations

from megalite.config import TORCH_DTYPES, Config

DISPATCHER_NAMES = {"alltoall": "all-to-all", "allgather": "all-gather"}


def routed_rows(cfg: Config, tokens: int) -> int:
    """Rows this rank's experts run per micro batch when it routes `tokens` tokens (balanced routing)."""
    rows = tokens * cfg.model.moe_topk
    return rows * cfg.parallel.ep if cfg.parallel.moe_dispatcher == "allgather" else rows


def routed_bytes(cfg: Config, tokens: int, compute: int) -> int:
    """Bytes the router, dispatch, experts and combine of one layer keep for `tokens` routed tokens (the shared
    expert aside); `compute`: bytes per element of the compute dtype."""
    m, p = cfg.model, cfg.parallel
    h, k, experts, width = m.hidden_size, m.moe_topk, m.num_experts, m.expert_ffn_size
    rows = routed_rows(cfg, tokens)
    router = tokens * h * 4 + tokens * experts * 4 + tokens * k * 8  # fp32 input, scores, chosen ids
    router += tokens * (k + 1) * 4 if m.moe_norm_topk_prob else 0  # chosen scores and their sums
    router += tokens * (experts + 1) * 4 if m.moe_z_loss_coeff else 0  # logits and their logsumexp
    sorting = 2 * rows * 8  # the expert order and each row's token
    if p.ep > 1:
        sorting += rows if p.moe_dispatcher == "allgather" else 2 * rows * 8  # mask / regrouping both ways
    gated = m.features.gated_mlp
    intermediates = 4 if gated else 2
    expert_rows = rows * h * compute + intermediates * rows * width * compute
    combine = 2 * rows * h * 4 + rows * 4  # rows as fp32, weighted, and their weights
    return router + sorting + expert_rows + combine


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


def describe(cfg: Config, tokens: int, layers: int, replicas: int) -> list[str]:
    """The plan's lines for mixture-of-experts layers: `layers` of them, `tokens` routed per rank and micro batch,
    the experts' state sharded over `replicas` (edp) ranks."""
    m, p = cfg.model, cfg.parallel
    local = m.num_experts // p.ep
    shared = f", shared expert {m.moe_shared_expert_size} wide" if m.moe_shared_expert_size else ""
    lines = [f"mixture of experts: {layers} of {m.num_layers} layers, {m.num_experts} experts {m.expert_ffn_size} "
             f"wide, top {m.moe_topk}{shared}; ep {p.ep} x edp {replicas} ({local} expert{'s' if local > 1 else ''} "
             f"per GPU, their gradients reduced over the {replicas} edp ranks)"]
    line = (f"expert dispatch: {DISPATCHER_NAMES[p.moe_dispatcher]}, {routed_rows(cfg, tokens)} rows per GPU per layer "
            f"per micro batch (balanced routing)")
    if p.ep > 1:
        forward, backward = comm_bytes(cfg, tokens)
        recomputed = ", layer forward recomputed" if cfg.train.recompute == "full" else ""
        line += (f"; {forward / 2**20:.1f} MiB sent per GPU per layer (forward), "
                 f"{backward / 2**20:.1f} MiB (backward{recomputed})")
    return [*lines, line]
