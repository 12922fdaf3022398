"""The LM head: logits, or per-token cross-entropy without materialising log-probabilities,
on one device (fused, model/cross_entropy.py) or over a vocabulary split across tensor-parallel
ranks (parallel/cross_entropy.py).

It is a module that reads its weight inside its own forward, so a forward pre-hook sees every
read: the distributed optimizer's overlapped parameter gather waits there for the head's bucket.
With embeddings tied on the same stage it owns no weight and is handed the embedding's, which
the same forward has already read through the embedding module.

Every path multiplies by the whole padded weight (shard), never a `[:vocab_size]` slice of it:
the padding keeps the GEMM's N a multiple of make_vocab_size_divisible_by, which is what gets
it onto the fast bf16 kernels. The losses mask the padded columns out of the softmax; returned
logits are sliced to the real vocabulary after the matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.model.cross_entropy import linear_cross_entropy
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.mappings import copy_to_tp, gather_from_sp, gather_from_tp, in_compute_dtype
from megalite.parallel.placement import Placement


class LMHead(nn.Module):
    """Rows of the padded vocabulary split across the tensor-parallel group; all are multiplied,
    only the first `vocab_size` are scored."""

    def __init__(self, hidden_size: int, padded_vocab_size: int, vocab_size: int, ctx: ParallelContext,
                 owns_weight: bool) -> None:
        super().__init__()
        self.ctx, self.vocab_size = ctx, vocab_size
        self.weight = nn.Parameter(torch.empty(padded_vocab_size // ctx.tp.size, hidden_size)) if owns_weight else None
        self.placements = {"weight": Placement.split("tp", 0)}

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [seq (/tp under SP), batch, hidden] -> fp32 losses [batch, seq] given labels [batch, seq],
        else logits [batch, seq, vocab]; `weight` is the tied embedding when this head owns none."""
        own = weight is None  # a borrowed (tied) weight also gets the embedding's gradient through autograd
        weight = self.weight if own else weight
        tp = self.ctx.tp
        if tp.size == 1:
            if labels is None:
                return gemm.linear(x, weight, final=own)[..., : self.vocab_size].transpose(0, 1)
            losses = linear_cross_entropy(x.flatten(0, 1), weight, labels.t().flatten(), self.vocab_size, own)
            return losses.view(labels.shape[1], labels.shape[0]).t()
        x = in_compute_dtype(x)  # the final norm's fp32 output would otherwise cross the TP group in fp32
        x = gather_from_sp(x, tp.group) if self.ctx.sequence_parallel else copy_to_tp(x, tp.group)
        logits = gemm.linear(x, weight, final=own)
        if labels is None:
            return gather_from_tp(logits, tp.group)[..., : self.vocab_size].transpose(0, 1)
        start = tp.rank * logits.shape[-1]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.t().flatten(), start, self.vocab_size,
                                              tp.group)
        return losses.view(labels.shape[1], labels.shape[0]).t()
