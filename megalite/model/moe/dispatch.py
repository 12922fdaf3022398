"""How tokens reach the ranks of the experts they were routed to, and come back weighted.

Every (token, choice) pair is a row: rows are sorted by expert (a stable sort, so each expert sees its tokens
in token order on every layout), run through the experts, and added back into their token weighted by
the router (fp32 sums, k rows per token in expert order). Between the two, the rows travel, as
parallel/expert_parallel.py moves them:

- `AllToAll` (the default): each rank sends every row to the rank holding its expert (and the ranks sharing that
  expert's matrices), in an all-to-all with uneven splits, read from the device once per layer per forward.
- `AllGather`: every rank gathers all tokens and choices of the group, runs its experts on the rows routed to
  them, and a reduce-scatter sums each token's rows back to its rank. No host read at all (the grouped GEMM
  takes its offsets on the device); each rank moves every token of the group, so it suits small ep.

With ep = 1 both are the local sort alone.

How many rows reach a rank's experts depends on the router; the planner assumes balanced routing
(`routed_rows`), as the dry run does (megalite/dryrun/routing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config import ModelConfig
from megalite.model.moe.router import Routing, capacity, expert_counts
from megalite.parallel.context import ParallelContext
from megalite.parallel.expert_parallel import ExpertAllGather, ExpertAllToAll


@dataclass
class Sorted:
    """Rows of (token, choice) pairs sorted by expert: which token each row is and its combine weight."""

    token: torch.Tensor  # [rows] index of the row's token
    weight: torch.Tensor  # [rows] fp32 combine weight
    counts: torch.Tensor  # [experts] rows per expert

    @classmethod
    def of(cls, experts: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Sorted:
        order = experts.reshape(-1).argsort(stable=True)
        counts = expert_counts(experts, num_experts)
        return cls(order // experts.shape[-1], weights.reshape(-1)[order], counts)

    @classmethod
    def within_capacity(cls, experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int,
                        by_weight: bool, pad: bool) -> Sorted:
        """The pairs each expert keeps, at most `capacity`: those of the highest weight (`by_weight`) or the first
        tokens. `pad`: exactly `capacity` rows per expert, the missing ones zero-weight rows of token 0, so the
        sizes are known without reading the device; else the kept rows only (one read, to select them)."""
        k, flat, w = experts.shape[-1], experts.reshape(-1), weights.reshape(-1)
        first = (-w.detach()).argsort(stable=True) if by_weight else torch.arange(len(flat), device=flat.device)
        order = first[flat[first].argsort(stable=True)]  # by expert, then by priority
        counts = expert_counts(experts, num_experts)
        slot = torch.arange(capacity, device=flat.device)
        kept = slot < counts[:, None]  # [experts, capacity]
        source = order[((counts.cumsum(0) - counts)[:, None] + slot).clamp(max=len(order) - 1)]
        token, weight = torch.where(kept, source // k, 0), torch.where(kept, w[source], 0.0)
        if pad:
            return cls(token.reshape(-1), weight.reshape(-1), torch.full_like(counts, capacity))
        return cls(token[kept], weight[kept], counts.clamp(max=capacity))

    @staticmethod
    def saved_bytes(rows: int, hidden: int) -> int:
        """For `rows` rows: the expert order and each row's token (int64); the combine's rows as fp32, their
        weighted copy (index_add keeps its source) and the rows' fp32 weights."""
        return 2 * rows * 8 + 2 * rows * hidden * 4 + rows * 4

    @staticmethod
    def backward_transient_bytes(rows: int, hidden: int) -> int:
        """The combine's backward beyond what it saved, for `rows` rows: the weighting's backward holds three fp32
        [rows, hidden] tensors at once (the output gradient gathered per row, the rows' gradient and their product
        with the rows before it is summed into the weights' gradient), the index_add having freed the weighted copy
        it kept."""
        return 3 * rows * hidden * 4 - rows * hidden * 4

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.index_select(0, self.token)

    def combine(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each token's rows summed into it, weighted, in fp32; returned in the rows' dtype."""
        out = rows.new_zeros((num_tokens, rows.shape[-1]), dtype=torch.float32)
        return out.index_add(0, self.token, rows.float() * self.weight.unsqueeze(-1)).to(rows.dtype)


class AllToAll:
    def __init__(self, ctx: ParallelContext, cfg: ModelConfig) -> None:
        self.cfg, self.num_experts = cfg, cfg.num_experts
        self.travel = ExpertAllToAll(ctx.ep, ctx.etp, cfg.num_experts // ctx.ep.size)

    def _sorted(self, routing: Routing) -> Sorted:
        cfg = self.cfg
        if cfg.moe_capacity_factor is None:
            return Sorted.of(routing.experts, routing.weights, self.num_experts)
        return Sorted.within_capacity(routing.experts, routing.weights, self.num_experts,
                                      capacity(cfg, routing.experts.shape[0]), cfg.moe_drop_policy == "probs",
                                      cfg.moe_pad_to_capacity)

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """tokens [T, hidden] -> (rows for this rank's experts grouped by expert, rows per local expert, state).
        Padded to the capacity, every expert gets exactly `capacity` rows from every rank: nothing to exchange."""
        pairs = self._sorted(routing)
        each = capacity(self.cfg, tokens.shape[0]) if self.cfg.moe_pad_to_capacity else None
        rows, counts, trip = self.travel.there(pairs.rows(tokens), pairs.counts, each)
        return rows, counts, (pairs, tokens.shape[0], trip)

    def routed_rows(self, tokens: int) -> int:
        """Rows this rank's experts run per micro batch when it routes `tokens` tokens, balanced routing assumed: as
        many as its own tokens chose."""
        return tokens * self.cfg.moe_topk

    def saved_bytes(self, rows: int, hidden: int) -> int:
        """The sort and combine, and with ep > 1 the regrouping of the received rows and its inverse (int64)."""
        return Sorted.saved_bytes(rows, hidden) + (2 * rows * 8 if self.travel.ep.size > 1 else 0)

    def combine(self, rows: torch.Tensor, state: tuple) -> torch.Tensor:
        pairs, num_tokens, trip = state
        return pairs.combine(self.travel.back(rows, trip), num_tokens)


class AllGather:
    def __init__(self, ctx: ParallelContext, cfg: ModelConfig) -> None:
        self.ep, self.num_experts, self.topk = ctx.ep, cfg.num_experts, cfg.moe_topk
        self.local = cfg.num_experts // ctx.ep.size
        self.travel = ExpertAllGather(ctx.ep_etp)

    def routed_rows(self, tokens: int) -> int:
        """Every row of the expert-parallel group (those of other ranks' experts masked): ep times its own."""
        return tokens * self.topk * self.ep.size

    def saved_bytes(self, rows: int, hidden: int) -> int:
        """The sort and combine, and with ep > 1 the mask of this rank's rows."""
        return Sorted.saved_bytes(rows, hidden) + (rows if self.ep.size > 1 else 0)

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Every rank of the etp x ep group gathers all their tokens; expert tensor-parallel ranks compute
        partial sums of the same rows, which the combine's reduce-scatter adds up with the other experts'."""
        tokens, weights, experts = self.travel.there(tokens, routing.weights, routing.experts)
        # This rank's experts first (ids shifted to 0..local-1), the others after them: the grouped GEMM runs
        # only the rows its offsets cover and leaves the others undefined, so they are masked out both ways
        # (a select, not a product: an undefined row may hold a NaN).
        shifted = (experts - self.ep.rank * self.local) % self.num_experts
        pairs = Sorted.of(shifted, weights, self.num_experts)
        mine = (torch.arange(pairs.token.shape[0], device=tokens.device) < pairs.counts[:self.local].sum())[:, None]
        rows = torch.where(mine, pairs.rows(tokens), 0.0)
        return rows, pairs.counts[:self.local], (pairs, tokens.shape[0], mine)

    def combine(self, rows: torch.Tensor, state: tuple) -> torch.Tensor:
        pairs, num_tokens, mine = state
        rows = torch.where(mine, rows, 0.0)
        return self.travel.back(pairs.combine(rows, num_tokens))


DISPATCHERS = {"alltoall": AllToAll, "allgather": AllGather}
