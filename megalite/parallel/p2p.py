"""Point-to-point transfers between pipeline ranks, grouped so that NCCL cannot deadlock.

Under NCCL a send or receive blocks its GPU stream until the peer's matching call runs, calls on one
communicator run in the order they were posted, only the calls of one group progress together, and messages
match in post order (tags are ignored). So every transfer here is part of an `Exchange`: one
`batch_isend_irecv` holding all the messages of one round of the schedule's communication plan
(pipeline/plan.py) between this rank and one neighbour, in an order both sides derive from the plan.

Each pair of neighbouring pipeline ranks has a communicator of its own (a two-rank process group): on the
pipeline group's one communicator, a batch to the next rank would queue behind a batch with the previous
one, so a rank waiting for its input would wait for the other neighbour too. The plan posts the exchanges in
one global order, so they cannot deadlock even where NCCL runs different communicators' calls one after
another (the NCCL-rule replay checks both). Shapes come from the config (no handshake).

An exchange is posted between two operations, where its host time delays the next one, so it is posted by
`post_batch`, not through torch's `batch_isend_irecv`: the same calls of the process group in the same order,
without the checks torch's function repeats for every message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.parallel import observed
from megalite.parallel.topology import Topology


@dataclass(frozen=True)
class Message:
    """One activation ("F", to the next rank) or gradient ("B", to the previous rank) of a micro
    batch, named by the chunk of the receiving rank that consumes it; src and dst are pipeline ranks."""

    kind: str
    chunk: int
    microbatch: int
    src: int
    dst: int

    @property
    def pair(self) -> tuple[int, int]:
        """The two pipeline ranks it travels between, lower first: whose communicator carries it."""
        return min(self.src, self.dst), max(self.src, self.dst)


@dataclass
class Exchange:
    """The in-flight batch of one round with one neighbour: wait() before reading what it received."""

    works: list[dist.Work]
    sent: dict[Message, torch.Tensor] = field(default_factory=dict)
    received: dict[Message, torch.Tensor] = field(default_factory=dict)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


@observed.one_batch
def post_batch(group: dist.ProcessGroup, coalescing: torch.device | None,
               messages: list[tuple[bool, torch.Tensor, int]]) -> list[dist.Work]:
    """Post `messages` (send or not, tensor, peer's rank in `group`) as one batch, with the process group's calls
    that torch's `batch_isend_irecv` makes: where the group's backend coalesces on `coalescing` (NCCL: one
    ncclGroupStart/End, so the batch progresses together), its sends and receives inside the group's coalescing,
    one work for all; elsewhere (gloo) each in turn, a work each. The NCCL-rule recorder takes the batch as one
    call, as it takes torch's function: it finds this function's frame above the group's calls (so a loop here,
    not a comprehension, which has a frame of its own before Python 3.12)."""
    if coalescing is not None:
        group._start_coalescing(coalescing)
    works = []
    for send, tensor, peer in messages:
        works.append(group.send([tensor], peer, 0) if send else group.recv([tensor], peer, 0))
    return [group._end_coalescing(coalescing)] if coalescing is not None else works


def coalescing_device(group: dist.ProcessGroup, device: torch.device) -> torch.device | None:
    """`device` where `group`'s backend on it batches calls (NCCL), else None: what post_batch needs, decided as
    torch's `batch_isend_irecv` decides it."""
    return device if type(group) is dist.ProcessGroup and group._get_backend(device).supports_coalescing else None


def neighbour_pairs(pp: int) -> list[tuple[int, int]]:
    """The pipeline-rank pairs that exchange messages: each rank and the next, the last and the first (the
    interleaved loop's turn), lower rank first, in ascending order."""
    return sorted({(min(r, (r + 1) % pp), max(r, (r + 1) % pp)) for r in range(pp) if pp > 1})


def pair_groups(topology: Topology) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A two-rank process group for every neighbour pair of every pipeline (each rank makes all of them, in the
    same order, as new_group needs); returns this rank's, by pipeline ranks."""
    t = topology
    timeout = timedelta(minutes=t.timeout_minutes) if t.timeout_minutes is not None else None
    mine = {}
    for ranks in t.grid.groups(("pp",)):
        for low, high in neighbour_pairs(t.pp):
            group = dist.new_group([ranks[low], ranks[high]], timeout=timeout, group_desc="pipeline-pair")
            if t.rank in (ranks[low], ranks[high]):
                mine[(low, high)] = group
    return mine


@dataclass
class PipelineComm:
    """The channel between this rank and its neighbouring pipeline ranks of its (dp, tp) position. What an
    exchange needs of the topology (this rank's pipeline rank, each pair's group and peer ranks in it) is looked
    up once here: an exchange is posted between operations, where its host time delays the next one."""

    topology: Topology
    shape: tuple[int, ...]
    dtype: torch.dtype
    groups: dict[tuple[int, int], dist.ProcessGroup] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.groups = pair_groups(self.topology)
        self._pp_rank = self.topology.pp_rank
        self._device = self.topology.device
        self._coalescing = {pair: coalescing_device(group, self._device) for pair, group in self.groups.items()}

    def exchange(self, messages: list[Message], outbox: dict[Message, torch.Tensor]) -> Exchange:
        """Post one round with one neighbour: send what `outbox` holds for the messages this rank sends,
        receive the others into new buffers. Both sides list a round's messages in the same order."""
        pair = messages[0].pair
        group = self.groups.get(pair)
        if group is None or any(message.pair != pair for message in messages[1:]):
            raise ValueError(f"an exchange travels between pipeline rank {self._pp_rank} and one neighbour, not "
                             f"{sorted({message.pair for message in messages})}: the schedule's chunk order must "
                             "put consecutive chunks on neighbouring ranks")
        posts, result = [], Exchange([])
        for message in messages:
            if message.src == self._pp_rank:
                result.sent[message] = tensor = outbox.pop(message).detach().contiguous()
                posts.append((True, tensor, pair.index(message.dst)))
            else:
                result.received[message] = buffer = torch.empty(self.shape, dtype=self.dtype, device=self._device)
                posts.append((False, buffer, pair.index(message.src)))
        result.works = post_batch(group, self._coalescing[pair], posts)
        return result
