"""How tokens reach the ranks of the experts they were routed to, and come back weighted.

Every (token, choice) pair is a row: rows are sorted by expert (a stable sort, so each expert sees its tokens
in token order on every layout), run through the experts, and added back into their token weighted by
the router (fp32 sums, k rows per token in expert order). Between the two, the rows travel:

- `AllToAll` (the default): each rank sends every row to the rank holding its expert, in one all-to-all over
  the expert-parallel group with uneven splits; under expert tensor parallelism the ranks sharing those
  experts' matrices then gather each other's rows (uneven too). The received rows (grouped by etp rank,
  source rank, then expert) are regrouped by expert for the grouped GEMM, and everything runs backwards on
  the way home (the etp ranks' partial outputs summed by a reduce-scatter). The split sizes must be known on
  the host: one read of the device per layer per forward (the expert counts of every rank, exchanged first
  in a small all-to-all and all-gather); backward reuses them.
- `AllGather`: every rank gathers all tokens and choices of the group, runs its experts on the rows routed to
  them, and a reduce-scatter sums each token's rows back to its rank. No host read at all (the grouped GEMM
  takes its offsets on the device); each rank moves every token of the group, so it suits small ep.

With ep = 1 both are the local sort alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.model.moe.router import Routing, capacity
from megalite.parallel.context import ParallelContext
from megalite.parallel.mappings import (
    all_gather_single,
    all_to_all,
    gather_from_ep,
    gather_rows_v,
    reduce_scatter_rows_v,
    reduce_scatter_to_ep,
)


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert of the expert ids `flat`. Not torch.bincount: its output's size depends on the largest id,
    which CUDA reads on the host (a sync per MoE layer) and a fake tensor cannot know (the dry run)."""
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


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
        counts = expert_counts(flat, num_experts)
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
        counts = expert_counts(flat, num_experts)
        slot = torch.arange(capacity, device=flat.device)
        kept = slot < counts[:, None]  # [experts, capacity]
        source = order[((counts.cumsum(0) - counts)[:, None] + slot).clamp(max=len(order) - 1)]
        token, weight = torch.where(kept, source // k, 0), torch.where(kept, w[source], 0.0)
        if pad:
            return cls(token.reshape(-1), weight.reshape(-1), torch.full_like(counts, capacity))
        return cls(token[kept], weight[kept], counts.clamp(max=capacity))

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.index_select(0, self.token)

    def combine(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each token's rows summed into it, weighted, in fp32; returned in the rows' dtype."""
        out = rows.new_zeros((num_tokens, rows.shape[-1]), dtype=torch.float32)
        return out.index_add(0, self.token, rows.float() * self.weight.unsqueeze(-1)).to(rows.dtype)


class AllToAll:
    def __init__(self, ctx: ParallelContext, cfg: ModelConfig) -> None:
        self.ep, self.etp, self.cfg, self.num_experts = ctx.ep, ctx.etp, cfg, cfg.num_experts
        self.local = cfg.num_experts // ctx.ep.size

    def _sorted(self, routing: Routing) -> Sorted:
        cfg = self.cfg
        if cfg.moe_capacity_factor is None:
            return Sorted.of(routing.experts, routing.weights, self.num_experts)
        return Sorted.within_capacity(routing.experts, routing.weights, self.num_experts,
                                      capacity(cfg, routing.experts.shape[0]), cfg.moe_drop_policy == "probs",
                                      cfg.moe_pad_to_capacity)

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """tokens [T, hidden] -> (rows for this rank's experts grouped by expert, rows per local expert, state)."""
        pairs = self._sorted(routing)
        rows = pairs.rows(tokens)
        if self.ep.size == 1 and self.etp.size == 1:
            return rows, pairs.counts, (pairs, tokens.shape[0], None)
        ep, etp, local = self.ep.size, self.etp.size, self.local
        if self.cfg.moe_pad_to_capacity:  # every expert gets `capacity` rows from every rank: nothing to exchange
            each = capacity(self.cfg, tokens.shape[0])
            received = torch.full((ep, local), each, dtype=pairs.counts.dtype, device=rows.device)
            blocks = received.expand(etp, ep, local)
            sent = got = [each * local] * ep
            shared = [each * local * ep] * etp
        else:
            received = pairs.counts  # rows this rank gets: [source rank, local expert]
            if ep > 1:
                received = torch.empty_like(pairs.counts)
                dist.all_to_all_single(received, pairs.counts, group=self.ep.group)
            received = received.view(ep, local)
            blocks = received.view(1, ep, local)
            if etp > 1:  # and the rows of the ranks sharing these experts' matrices: [etp rank, source, expert]
                gathered = received.new_empty((etp * ep, local))
                all_gather_single(gathered, received.contiguous(), self.etp.group)
                blocks = gathered.view(etp, ep, local)
            sent, got, shared = self.split_sizes(pairs, received, blocks)
        rows = gather_rows_v(all_to_all(rows, self.ep.group, got, sent), self.etp.group, shared)
        expert = torch.arange(local, device=rows.device).repeat(etp * ep)
        regroup = expert.repeat_interleave(blocks.reshape(-1), output_size=sum(shared)).argsort(stable=True)
        travel = (regroup, sent, got, shared)
        return rows.index_select(0, regroup), blocks.sum((0, 1)), (pairs, tokens.shape[0], travel)

    def split_sizes(self, pairs: Sorted, received: torch.Tensor, blocks: torch.Tensor) -> tuple[list[int], ...]:
        """Rows sent to each ep rank, received from each, held by each etp rank: the one host read (the dry run,
        whose fake tensors hold no counts, puts balanced routing in its place: megalite/dryrun/routing.py)."""
        ep = self.ep.size
        sizes = torch.cat([pairs.counts.view(ep, self.local).sum(1), received.sum(1), blocks.sum((1, 2))]).tolist()
        return sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]

    def combine(self, rows: torch.Tensor, state: tuple) -> torch.Tensor:
        pairs, num_tokens, travel = state
        if travel is not None:
            regroup, sent, got, shared = travel
            back = torch.empty_like(regroup).scatter_(0, regroup, torch.arange(len(regroup), device=rows.device))
            rows = reduce_scatter_rows_v(rows.index_select(0, back), self.etp.group, shared)
            rows = all_to_all(rows, self.ep.group, sent, got)
        return pairs.combine(rows, num_tokens)


class AllGather:
    def __init__(self, ctx: ParallelContext, cfg: ModelConfig) -> None:
        self.ep, self.group, self.num_experts = ctx.ep, ctx.ep_etp, cfg.num_experts
        self.local = cfg.num_experts // ctx.ep.size

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Every rank of the etp x ep group gathers all their tokens; expert tensor-parallel ranks compute
        partial sums of the same rows, which the combine's reduce-scatter adds up with the other experts'."""
        tokens = gather_from_ep(tokens, self.group.group)
        weights = gather_from_ep(routing.weights, self.group.group)
        experts = routing.experts
        if self.group.size > 1:
            experts = routing.experts.new_empty((self.group.size * experts.shape[0], experts.shape[1]))
            all_gather_single(experts, routing.experts.contiguous(), self.group.group)
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
        return reduce_scatter_to_ep(pairs.combine(rows, num_tokens), self.group.group)


DISPATCHERS = {"alltoall": AllToAll, "allgather": AllGather}
