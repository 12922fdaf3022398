"""How tokens reach the ranks of the experts they were routed to, and come back weighted.

Every (token, choice) pair is a row: rows are sorted by expert (a stable sort, so each expert sees its tokens
in token order on every layout), run through the experts, and added back into their token weighted by
the router (fp32 sums, k rows per token in expert order). Between the two, the rows travel:

- `AllToAll` (the default): each rank sends every row to the rank holding its expert, in one all-to-all over
  the expert-parallel group with uneven splits; the received rows (grouped by source rank, then expert) are
  regrouped by expert for the grouped GEMM, and everything runs backwards on the way home. The split sizes
  must be known on the host: one read of the device per layer per forward (the expert counts of every rank,
  exchanged first in a small all-to-all); backward reuses them.
- `AllGather`: every rank gathers all tokens and choices of the group, runs its experts on the rows routed to
  them, and a reduce-scatter sums each token's rows back to its rank. No host read at all (the grouped GEMM
  takes its offsets on the device); each rank moves every token of the group, so it suits small ep.

With ep = 1 both are the local sort alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.model.moe.router import Routing
from megalite.parallel.context import AxisView
from megalite.parallel.mappings import all_to_all, gather_from_ep, reduce_scatter_to_ep


@dataclass
class Sorted:
    """Rows of (token, choice) pairs sorted by expert: which token each row is and its combine weight."""

    token: torch.Tensor  # [rows] index of the row's token
    weight: torch.Tensor  # [rows] fp32 combine weight
    counts: torch.Tensor  # [experts] rows per expert

    @classmethod
    def of(cls, experts: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Sorted:
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        return cls(order // experts.shape[-1], weights.reshape(-1)[order], counts)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.index_select(0, self.token)

    def combine(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each token's rows summed into it, weighted, in fp32; returned in the rows' dtype."""
        out = rows.new_zeros((num_tokens, rows.shape[-1]), dtype=torch.float32)
        return out.index_add(0, self.token, rows.float() * self.weight.unsqueeze(-1)).to(rows.dtype)


class AllToAll:
    def __init__(self, ep: AxisView, num_experts: int) -> None:
        self.ep, self.num_experts = ep, num_experts
        self.local = num_experts // ep.size

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """tokens [T, hidden] -> (rows for this rank's experts grouped by expert, rows per local expert, state)."""
        pairs = Sorted.of(routing.experts, routing.weights, self.num_experts)
        rows = pairs.rows(tokens)
        if self.ep.size == 1:
            return rows, pairs.counts, (pairs, tokens.shape[0], None)
        ep, local = self.ep.size, self.local
        received = torch.empty_like(pairs.counts)
        dist.all_to_all_single(received, pairs.counts, group=self.ep.group)  # [source rank, local expert]
        received = received.view(ep, local)
        splits = torch.stack([pairs.counts.view(ep, local).sum(1), received.sum(1)]).tolist()  # the host read
        sent, got = splits
        rows = all_to_all(rows, self.ep.group, got, sent)
        expert = torch.arange(local, device=rows.device).repeat(ep)
        regroup = expert.repeat_interleave(received.reshape(-1), output_size=sum(got)).argsort(stable=True)
        return rows.index_select(0, regroup), received.sum(0), (pairs, tokens.shape[0], (regroup, sent, got))

    def combine(self, rows: torch.Tensor, state: tuple) -> torch.Tensor:
        pairs, num_tokens, travel = state
        if travel is not None:
            regroup, sent, got = travel
            back = torch.empty_like(regroup).scatter_(0, regroup, torch.arange(len(regroup), device=rows.device))
            rows = all_to_all(rows.index_select(0, back), self.ep.group, sent, got)
        return pairs.combine(rows, num_tokens)


class AllGather:
    def __init__(self, ep: AxisView, num_experts: int) -> None:
        self.ep, self.num_experts = ep, num_experts
        self.local = num_experts // ep.size

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        tokens = gather_from_ep(tokens, self.ep.group)
        weights = gather_from_ep(routing.weights, self.ep.group)
        experts = routing.experts
        if self.ep.size > 1:
            experts = routing.experts.new_empty((self.ep.size * experts.shape[0], experts.shape[1]))
            dist.all_gather_into_tensor(experts, routing.experts.contiguous(), group=self.ep.group)
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
        return reduce_scatter_to_ep(pairs.combine(rows, num_tokens), self.ep.group)


DISPATCHERS = {"alltoall": AllToAll, "allgather": AllGather}
