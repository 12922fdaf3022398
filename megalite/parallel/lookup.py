"""Embedding lookups whose one gradient, the table's, is handed to weight_grads.py (in W under a zero-bubble
schedule), as the matmuls' weight gradients are (gemm.py): the same embedding_dense_backward autograd would run,
bit for bit. The vocabulary-parallel embedding (layers.py) and the learned positions look up through here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.weight_grads import deliver


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight), the weight's gradient handed to weight_grads."""
    return _Embedding.apply(ids, weight)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # on ctx: a checkpoint's recompute would save a copy, not the parameter
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        (ids,), weight = ctx.saved_tensors, ctx.weight
        if ctx.needs_input_grad[1]:
            rows = weight.shape[0]
            deliver(weight, lambda: torch.ops.aten.embedding_dense_backward(grad, ids, rows, -1, False).to(
                weight.dtype))
        return None, None


class Lookup(nn.Embedding):
    """A whole (unsplit) embedding table looked up through `embedding` (learned positions): a module, so that
    what waits for its parameter before a forward (the distributed optimizer's gathers) sees the read."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight)
