"""Point-to-point transfers between adjacent pipeline ranks.

Shapes come from the config (no handshake). Each schedule step posts all of its sends and
receives as one batch, activations (to the next rank) before gradients (to the previous
rank), each kind with its own tag: with pp = 2 both neighbours are the same rank, and this
order keeps the sender's and the receiver's sequence of messages identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel.topology import Topology

ACTIVATION, GRADIENT = 1, 2


@dataclass
class PipelineComm:
    topology: Topology
    shape: tuple[int, ...]
    dtype: torch.dtype

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.topology.device, requires_grad=True)

    def communicate(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                    recv_prev: bool = False, recv_next: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send/receive in one batch; returns (activation from prev, gradient from next)."""
        t = self.topology
        from_prev = self._buffer() if recv_prev else None
        from_next = self._buffer() if recv_next else None
        ops = []
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), t.next_rank, tag=ACTIVATION))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev.data, t.prev_rank, tag=ACTIVATION))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.detach().contiguous(), t.prev_rank, tag=GRADIENT))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next.data, t.next_rank, tag=GRADIENT))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        if from_next is not None:
            from_next = from_next.detach()
        return from_prev, from_next
