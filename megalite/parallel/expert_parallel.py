"""How a mixture of experts' rows reach the ranks of their experts and come back: the dispatchers' communication.

The experts are split over the expert-parallel (ep) ranks, num_experts/ep consecutive ones each, and each
expert's matrices over the expert-tensor-parallel (etp) ranks. A row is one (token, choice) pair; the model
(model/moe/dispatch.py) sorts its rows by expert and weighs them back into their tokens; this file moves them.

- `ExpertAllToAll`: each rank sends every row to the ep rank holding its expert, in one all-to-all over the ep
  group with uneven splits; the etp ranks sharing those experts' matrices then gather each other's rows (uneven
  too). The received rows (grouped by etp rank, source rank, then expert) are regrouped by expert for the grouped
  GEMM, and everything runs backwards on the way home (the etp ranks' partial outputs summed by a reduce-scatter).
  The split sizes must be known on the host: the expert counts of every rank are exchanged first (a small
  all-to-all and all-gather) and read once per layer per forward (`read_split_sizes`); backward reuses them. A
  run that cannot read them (the dry run's fake tensors hold no counts) assumes balanced routing instead, as the
  planner does (`balanced_split_sizes`); with a fixed number of rows per expert there is nothing to read.
- `ExpertAllGather`: every rank of the etp x ep group gathers all their tokens and routing, and a reduce-scatter
  sums each token's outputs back to its rank. No host read at all; each rank moves every token of the group.

Rows travel through mappings.py's autograd pairs (all_to_all, gather_rows_v, ...); expert ids and counts, which
carry no gradient, are exchanged outside autograd here (`sum_counts`, `_exchange_counts`, `_gather_ids`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from megalite.parallel.context import AxisView
from megalite.parallel.mappings import (
    all_gather_single,
    all_to_all,
    gather_from_ep,
    gather_rows_v,
    reduce_scatter_rows_v,
    reduce_scatter_to_ep,
)

SplitSizes = tuple[list[int], list[int], list[int]]  # rows sent to each ep rank, got from each, held by each etp rank


def sum_counts(counts: torch.Tensor, group: AxisView) -> torch.Tensor:
    """Expert counts summed over `group`'s ranks, in place, outside autograd (counts carry no gradient)."""
    if group.size > 1:
        dist.all_reduce(counts, group=group.group)
    return counts


class Trip(NamedTuple):
    """What the way home needs: the regrouping by expert and the split sizes of the way there."""

    regroup: torch.Tensor
    sent: list[int]
    got: list[int]
    shared: list[int]


class ExpertAllToAll:
    """Rows sorted by (global) expert to the ranks holding their experts, grouped by local expert, and back.
    `split_sizes` finds the uneven splits: `read_split_sizes` (the device's counts) or `balanced_split_sizes`."""

    def __init__(self, ep: AxisView, etp: AxisView, local: int,
                 split_sizes: Callable[..., SplitSizes] | None = None) -> None:
        self.ep, self.etp, self.local = ep, etp, local
        self.split_sizes = split_sizes or read_split_sizes

    def there(self, rows: torch.Tensor, counts: torch.Tensor,
              each: int | None = None) -> tuple[torch.Tensor, torch.Tensor, Trip | None]:
        """rows [n, hidden] sorted by expert, `counts` [experts] rows per expert (`each`: exactly that many rows
        per expert from every rank, nothing to exchange) -> (this rank's experts' rows grouped by local expert,
        rows per local expert, the trip for `back`)."""
        if self.ep.size == 1 and self.etp.size == 1:
            return rows, counts, None
        ep, etp, local = self.ep.size, self.etp.size, self.local
        if each is not None:
            received = torch.full((ep, local), each, dtype=counts.dtype, device=rows.device)
            blocks = received.expand(etp, ep, local)
            sent = got = [each * local] * ep
            shared = [each * local * ep] * etp
        else:
            received, blocks = self._exchange_counts(counts)
            sent, got, shared = self.split_sizes(self, rows.shape[0], counts, received, blocks)
        rows = gather_rows_v(all_to_all(rows, self.ep.group, got, sent), self.etp.group, shared)
        expert = torch.arange(local, device=rows.device).repeat(etp * ep)
        regroup = expert.repeat_interleave(blocks.reshape(-1), output_size=sum(shared)).argsort(stable=True)
        return rows.index_select(0, regroup), blocks.sum((0, 1)), Trip(regroup, sent, got, shared)

    def _exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows this rank gets [source rank, local expert], and those of the ranks sharing these experts'
        matrices [etp rank, source rank, local expert]."""
        ep, etp, local = self.ep.size, self.etp.size, self.local
        received = counts
        if ep > 1:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.ep.group)
        received = received.view(ep, local)
        blocks = received.view(1, ep, local)
        if etp > 1:
            gathered = received.new_empty((etp * ep, local))
            all_gather_single(gathered, received.contiguous(), self.etp.group)
            blocks = gathered.view(etp, ep, local)
        return received, blocks

    def back(self, rows: torch.Tensor, trip: Trip | None) -> torch.Tensor:
        """The experts' output rows (as `there` returned them) back to their ranks, in the order sent."""
        if trip is None:
            return rows
        home = torch.empty_like(trip.regroup).scatter_(0, trip.regroup,
                                                        torch.arange(len(trip.regroup), device=rows.device))
        rows = reduce_scatter_rows_v(rows.index_select(0, home), self.etp.group, trip.shared)
        return all_to_all(rows, self.ep.group, trip.sent, trip.got)


def read_split_sizes(travel: ExpertAllToAll, rows: int, counts: torch.Tensor, received: torch.Tensor,
                     blocks: torch.Tensor) -> SplitSizes:
    """Rows sent to each ep rank, received from each, held by each etp rank: the one host read."""
    ep = travel.ep.size
    sizes = torch.cat([counts.view(ep, travel.local).sum(1), received.sum(1), blocks.sum((1, 2))]).tolist()
    return sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]


def balanced_split_sizes(travel: ExpertAllToAll, rows: int, counts: torch.Tensor, received: torch.Tensor,
                         blocks: torch.Tensor) -> SplitSizes:
    """The split sizes of balanced routing, read from no value: the planner's assumption (planning/experts.py),
    which the dry run takes. Every expert gets the same share of the rows on every rank, so a rank sends rows/ep
    to each ep rank (the remainder to the first ones), gets as many from each as it keeps for itself, and each etp
    rank holds all the rows its ep group got."""
    ep = travel.ep.size
    sent = [rows // ep + (i < rows % ep) for i in range(ep)]
    got = [sent[travel.ep.rank]] * ep
    return sent, got, [sum(got)] * travel.etp.size


class ExpertAllGather:
    """Every rank of the etp x ep `group` gets all their tokens and routing; their outputs, partial sums over the
    group's experts (and etp shards), are summed back onto each token's rank."""

    def __init__(self, group: AxisView) -> None:
        self.group = group

    def there(self, tokens: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T, hidden], combine weights and expert ids [T, k] -> those of every rank of the group."""
        tokens, weights = gather_from_ep(tokens, self.group.group), gather_from_ep(weights, self.group.group)
        return tokens, weights, self._gather_ids(experts)

    def _gather_ids(self, experts: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return experts
        gathered = experts.new_empty((self.group.size * experts.shape[0], experts.shape[1]))
        all_gather_single(gathered, experts.contiguous(), self.group.group)
        return gathered

    def back(self, out: torch.Tensor) -> torch.Tensor:
        """The group's outputs for every token [group x T, hidden] -> this rank's tokens', summed over the group."""
        return reduce_scatter_to_ep(out, self.group.group)
