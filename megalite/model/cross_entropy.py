"""The LM head and cross-entropy as one autograd function, without materialising
log-probabilities or their gradient for the whole batch.

`F.cross_entropy(F.linear(x, w), labels)` writes the logits, then log-softmax over them,
then in backward a zero-filled gradient, the log-softmax gradient and the logits
gradient: five passes over a [tokens, vocab] tensor that is far larger than any cache
(412 MB in fp32 for 2048 tokens and a 50k vocabulary), and on CPUs those passes cost
about as much as the head's matmuls. Here the forward turns the logits, a few rows at a
time while they sit in cache, into the gradient of the per-token loss with respect to
them, softmax - onehot, written over the logits in place; backward only scales that by
the incoming per-token gradient (folded into the matmul operands, so [tokens, vocab] is
not touched again) and runs the two matmuls. The values are those of
log_softmax + nll_loss, computed in fp32 from logits in the compute dtype, as before.

Both matmuls use the whole padded weight: slicing it to the real vocabulary would give the
GEMMs an odd N (50257 for GPT-2) that keeps cuBLAS off its fast bf16 kernels, which is what
the padding is for. The padded columns are set to -inf in each chunk before the softmax, so
they take no probability mass, their gradient is exactly zero, and so is that of the padded
weight rows.
"""

from __future__ import annotations

import torch

from megalite.parallel import gemm
from megalite.parallel.mappings import in_compute_dtype
from megalite.parallel.weight_grads import opaque_backward

# The fp32 bytes of logits turned into their gradient at a time: on CPUs a chunk's log-softmax must stay in
# cache (a few MiB); accelerators stream whole tensors quickly and pay per kernel launch instead.
CPU_CHUNK_BYTES = 4 * 2**20
ACCELERATOR_CHUNK_BYTES = 2**30


def chunk_bytes(device_type: str) -> int:
    """The chunk a device of this type computes fastest with."""
    return CPU_CHUNK_BYTES if device_type == "cpu" else ACCELERATOR_CHUNK_BYTES


def chunk_rows(padded_vocab: int, nbytes: int) -> int:
    """Rows of logits turned into their gradient at a time, `nbytes` of fp32 logits (the planner counts their
    fp32 copies too)."""
    return max(1, nbytes // (4 * padded_vocab))


def _loss_and_grad(chunk: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """The fp32 losses of a chunk of logits, whose values become their gradient (softmax - onehot) in place. A
    function of its own so that its fp32 temporaries die at its return, not when the next chunk reassigns them
    (that kept three chunks' worth alive at once: found by the dry run)."""
    chunk[:, vocab:] = float("-inf")  # -inf in every float dtype: exp gives exactly 0, no overflow
    target = labels.unsqueeze(1)
    log_probs = torch.log_softmax(chunk, dim=1, dtype=torch.float32)
    losses = log_probs.gather(1, target).squeeze(1).neg()
    chunk.copy_(log_probs.exp_().scatter_add_(1, target, torch.full(target.shape, -1.0, device=chunk.device)))
    return losses


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int, recipe: gemm.Recipe,
                nbytes: int) -> torch.Tensor:
        """x [n, h], weight [padded_vocab, h], labels [n] -> fp32 losses [n] over the first `vocab` rows."""
        grad_logits = recipe.linear(x, weight, None)
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        rows = chunk_rows(weight.shape[0], nbytes)
        for start in range(0, x.shape[0], rows):
            losses[start : start + rows] = _loss_and_grad(grad_logits[start : start + rows],
                                                          labels[start : start + rows], vocab)
        ctx.save_for_backward(x, grad_logits)
        ctx.weight, ctx.recipe = weight, recipe
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        x, grad_logits = ctx.saved_tensors
        grad_x = opaque_backward(_backward, [x, grad_losses.contiguous(), ctx.weight, grad_logits], recipe=ctx.recipe,
                                needs_weight=ctx.needs_input_grad[1])
        return grad_x, None, None, None, None, None


def _backward(x: torch.Tensor, grad_losses: torch.Tensor, weight: torch.Tensor, grad_logits: torch.Tensor, *,
              recipe: gemm.Recipe, needs_weight: bool) -> torch.Tensor:
    """The input gradient, returned; the weight's (the logits gradient, scaled per token, times x) handed to
    weight_grads: at once, or in W, which then keeps the logits gradient and the scaled x."""
    scale = grad_losses.unsqueeze(1)
    grad_x = (recipe.linear_input_grad(grad_logits, weight) * scale).to(x.dtype)
    if needs_weight:
        gemm.weight_grad(weight, grad_logits, (x * scale).to(x.dtype), recipe)
    return grad_x


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int,
                         recipe: gemm.Recipe = gemm.HIGH_PRECISION, nbytes: int | None = None) -> torch.Tensor:
    """Per-token fp32 `cross_entropy(x @ weight[:vocab].T, labels)`, computed with the whole padded
    `weight` and its padded columns masked; x [n, h], labels [n]. `nbytes`: the chunk of logits turned into
    their gradient at a time (default: the fastest for x's device type, `chunk_bytes`).

    Under autocast the matmuls run in the autocast dtype, as F.linear's would (the weight is cast inside,
    so the parameter itself reaches gemm.weight_grad). A non-finite per-token gradient scale (fp16 loss
    scaling overflowing in x * scale) shows up as non-finite gradients, which the loss scaler catches.
    """
    nbytes = chunk_bytes(x.device.type) if nbytes is None else nbytes
    return _LinearCrossEntropy.apply(in_compute_dtype(x), weight, labels, vocab, recipe, nbytes)
