"""The LM head: logits, or per-token cross-entropy without materialising log-probabilities,
on one device (fused, model/cross_entropy.py) or over a vocabulary split across tensor-parallel
ranks (parallel/cross_entropy.py).

It is a module that reads its weight inside its own forward, so a forward pre-hook sees every
read: the distributed optimizer's overlapped parameter gather waits there for the head's bucket.
With embeddings tied on the same stage it owns no weight and is handed the embedding's, which
the same forward has already read through the embedding module (both readers' gradients meet in the
gradient buffer: parallel/grad_buffer.py). Its matmuls run with its `recipe` (parallel/gemm.py), and the fused
cross-entropy turns `loss_chunk_bytes` of logits into their gradient at a time (None: what suits the device it
runs on; a dry run on the CPU standing for a GPU sets the accelerators').

Every path multiplies by the whole padded weight (shard), never a `[:vocab_size]` slice of it:
the padding keeps the GEMM's N a multiple of make_vocab_size_divisible_by, which is what gets
it onto the fast bf16 kernels. The losses mask the padded columns out of the softmax; returned
logits are sliced to the real vocabulary after the matmul.

Its costs (model/costs.py): its input; one device keeps the [tokens, padded vocabulary] logits gradient in the
compute dtype, vocab-parallel cross-entropy fp32 probabilities of its shard; per token it multiplies the weight
rows of the real vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.model.costs import MicroBatch
from megalite.model.cross_entropy import chunk_bytes, chunk_rows, linear_cross_entropy
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
        self.ctx, self.vocab_size, self.hidden_size = ctx, vocab_size, hidden_size
        self.rows = padded_vocab_size // ctx.tp.size  # this rank's rows of the (own or tied) weight
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size)) if owns_weight else None
        self.placements = {"weight": Placement.split("tp", 0)}
        self.recipe = gemm.HIGH_PRECISION
        self.operand_splits = ctx.operand_splits(out="tp")  # vocabulary rows over tp, as a column-parallel layer's
        self.loss_chunk_bytes: int | None = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [seq (/tp under SP), batch, hidden] -> fp32 losses [batch, seq] given labels [batch, seq],
        else logits [batch, seq, vocab]; `weight` is the tied embedding when this head owns none."""
        weight = self.weight if weight is None else weight
        tp = self.ctx.tp
        if tp.size == 1:
            if labels is None:
                return gemm.linear(x, weight, recipe=self.recipe)[..., : self.vocab_size].transpose(0, 1)
            losses = linear_cross_entropy(x.flatten(0, 1), weight, labels.t().flatten(), self.vocab_size, self.recipe,
                                          self.loss_chunk_bytes)
            return losses.view(labels.shape[1], labels.shape[0]).t()
        x = in_compute_dtype(x)  # the final norm's fp32 output would otherwise cross the TP group in fp32
        x = gather_from_sp(x, tp.group) if self.ctx.sequence_parallel else copy_to_tp(x, tp.group)
        logits = gemm.linear(x, weight, recipe=self.recipe)
        if labels is None:
            return gather_from_tp(logits, tp.group)[..., : self.vocab_size].transpose(0, 1)
        start = tp.rank * logits.shape[-1]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.t().flatten(), start, self.vocab_size,
                                              tp.group)
        return losses.view(labels.shape[1], labels.shape[0]).t()

    def saved_bytes(self, batch: MicroBatch) -> int:
        """Its input, the logits gradient (one device; over the padded vocabulary, padding masked) or the fp32
        probabilities with the local label ids and ownership mask (vocab-parallel), the per-token losses and the
        loss mask."""
        tokens = batch.tokens
        if self.ctx.tp.size == 1:
            logits, kept = tokens * self.rows * batch.compute, tokens * self.hidden_size * batch.compute
        else:  # the gathered input, as the recipe keeps it (parallel/gemm.py)
            logits = tokens * (self.rows * 4 + 8 + 1)
            kept = self.recipe.kept_input_bytes(tokens, self.hidden_size, batch.compute)
        return kept + logits + tokens * 8

    def transient_bytes(self, batch: MicroBatch) -> int:
        """One device turns the logits into their gradient a chunk of rows at a time (model/cross_entropy.py): each
        chunk cast to fp32 and its log-softmax, two fp32 copies (one when the logits are fp32), at the accelerators'
        chunk size (a CPU's is a few MiB). Vocab-parallel cross-entropy holds the logits in the compute dtype
        beside their fp32 copy (saved), and in backward the gradient's cast back to the compute dtype."""
        if self.ctx.tp.size == 1:
            rows = min(batch.tokens, chunk_rows(self.rows, chunk_bytes("cuda")))
            return (1 if batch.compute == 4 else 2) * rows * self.rows * 4
        return batch.tokens * self.rows * batch.compute if batch.compute != 4 else 0

    def held_bytes(self, batch: MicroBatch) -> int:
        """The input (on one device scaled per token; vocab-parallel, gathered) and the logits' gradient (on one
        device already saved, kept now until W)."""
        return batch.tokens * (self.hidden_size + self.rows) * batch.compute

    def matmul_parameters(self) -> int:
        return self.hidden_size * self.vocab_size
