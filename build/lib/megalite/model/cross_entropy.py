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
from megalite.parallel.weight_grads import split_backward, weight_grad

# Rows per chunk: on CPUs a chunk's fp32 log-softmax must stay in cache (a few MiB);
# accelerators stream whole tensors quickly and pay per kernel launch instead.
_CHUNK_BYTES = {"cpu": 4 * 2**20}
_DEFAULT_CHUNK_BYTES = 2**30


def chunk_rows(padded_vocab: int, device_type: str) -> int:
    """Rows of logits turned into their gradient at a time (the planner counts their fp32 copies too)."""
    return max(1, _CHUNK_BYTES.get(device_type, _DEFAULT_CHUNK_BYTES) // (4 * padded_vocab))


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
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int,
                final: bool) -> torch.Tensor:
        """x [n, h], weight [padded_vocab, h], labels [n] -> fp32 losses [n] over the first `vocab` rows."""
        grad_logits = gemm.forward(x, weight, None)
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        rows = chunk_rows(weight.shape[0], x.device.type)
        for start in range(0, x.shape[0], rows):
            losses[start : start + rows] = _loss_and_grad(grad_logits[start : start + rows],
                                                          labels[start : start + rows], vocab)
        ctx.save_for_backward(x, grad_logits)
        ctx.weight, ctx.final = weight, final
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        x, grad_logits = ctx.saved_tensors
        grad_x = split_backward(_backward, [x, grad_losses.contiguous(), ctx.weight, grad_logits], final=ctx.final,
                                needs_weight=ctx.needs_input_grad[1])
        return grad_x, None, None, None, None


def _backward(x: torch.Tensor, grad_losses: torch.Tensor, weight: torch.Tensor, grad_logits: torch.Tensor, *,
              final: bool, needs_weight: bool) -> torch.Tensor:
    """The input gradient, returned; the weight's (the logits gradient, scaled per token, times x) handed to
    weight_grads: at once, or in W, which then keeps the logits gradient and the scaled x."""
    scale = grad_losses.unsqueeze(1)
    grad_x = (gemm.input_grad(grad_logits, weight) * scale).to(x.dtype)
    if needs_weight:
        scaled = (x * scale).to(x.dtype)
        weight_grad(weight, lambda: gemm.weight_grad(weight, grad_logits, scaled, final), final)
    return grad_x


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int,
                         final: bool = True) -> torch.Tensor:
    """Per-token fp32 `cross_entropy(x @ weight[:vocab].T, labels)`, computed with the whole padded
    `weight` and its padded columns masked; x [n, h], labels [n].

    Under autocast the matmuls run in the autocast dtype, as F.linear's would (the weight is cast inside,
    so the parameter itself reaches gemm.weight_grad). A non-finite per-token gradient scale (fp16 loss
    scaling overflowing in x * scale) shows up as non-finite gradients, which the loss scaler catches.
    `final`: as in gemm.linear.
    """
    return _LinearCrossEntropy.apply(in_compute_dtype(x), weight, labels, vocab, final)
