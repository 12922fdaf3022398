"""Point-to-point transfers between pipeline ranks, grouped so that NCCL cannot deadlock.

Under NCCL a send or receive blocks its GPU stream until the peer's matching call runs, calls
on a stream run in the order they were posted, only the calls of one group progress together,
and messages match in post order (tags are ignored). So every transfer here is part of an
`Exchange`: one `batch_isend_irecv` over the pipeline group holding all the sends and receives
of one round of the schedule's communication plan (schedules.py), in an order both sides
derive from the plan. Shapes come from the config (no handshake).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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


@dataclass
class Exchange:
    """The in-flight batch of one round: wait() before reading what it received."""

    works: list[dist.Work]
    sent: dict[Message, torch.Tensor] = field(default_factory=dict)
    received: dict[Message, torch.Tensor] = field(default_factory=dict)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


@dataclass
class PipelineComm:
    """The channel between this rank and the other pipeline ranks of its (dp, tp) position."""

    topology: Topology
    shape: tuple[int, ...]
    dtype: torch.dtype

    def exchange(self, messages: list[Message], outbox: dict[Message, torch.Tensor]) -> Exchange:
        """Post one round: send what `outbox` holds for the messages this rank sends, receive the
        others into new buffers. Every rank lists a round's messages in the same order."""
        t, ops, result = self.topology, [], Exchange([])
        for message in messages:
            if message.src == t.pp_rank:
                result.sent[message] = tensor = outbox.pop(message).detach().contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, group=t.pp_group, group_peer=message.dst))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=t.device)
                result.received[message] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer, group=t.pp_group, group_peer=message.src))
        result.works = dist.batch_isend_irecv(ops) if ops else []
        return result
