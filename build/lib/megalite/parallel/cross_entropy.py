"""Cross-entropy over vocabulary-sharded logits, without ever gathering them.

Each rank holds the logits of its vocabulary slice. The row max, the sum of exponentials
and the target logit are all-reduced over the TP group (three [tokens] vectors, never
[tokens, vocab]). The logits come from the whole padded weight shard, so the GEMM keeps its
padded (fast) shape; the rank holding the padding sets those columns to -inf here, so they take
no probability mass and get exactly zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        """logits [n, vocab_per_rank] (any float dtype), labels [n] global ids -> fp32 losses [n]."""
        logits32 = logits.float()
        logits32[:, max(0, vocab_size - vocab_start) :] = float("-inf")  # empty on ranks without padding
        row_max = logits32.max(dim=1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        logits32.sub_(row_max.unsqueeze(1))
        local = labels - vocab_start
        owned = (local >= 0) & (local < logits.shape[1])
        local = local.masked_fill(~owned, 0)
        target = logits32.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~owned, 0.0)
        probs = logits32.exp_()
        sum_exp = probs.sum(dim=1)
        stacked = torch.stack((sum_exp, target))
        dist.all_reduce(stacked, group=group)
        sum_exp, target = stacked
        probs.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(probs, local, owned)
        ctx.dtype = logits.dtype
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        probs, local, owned = ctx.saved_tensors
        grad = probs.scatter_add_(1, local.unsqueeze(1), -owned.to(probs.dtype).unsqueeze(1))
        grad.mul_(grad_losses.unsqueeze(1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, vocab_size, group)
