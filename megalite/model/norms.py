"""Normalisation layers: NVIDIA apex's fused kernels on CUDA when installed, torch's otherwise.
apex's norms keep only what backward needs; on CUDA torch's RMSNorm is a fused kernel too (it keeps its input
and rstd, measured on an H100, see the planner). apex's are unmeasured: the GPU we ran on had no apex.

Both compute the same function with the same parameters (`weight`, and `bias` for
LayerNorm), so checkpoints do not depend on which implementation ran.

With train.fusions (the default) torch's norms run in their input's dtype when their parameters share it,
autocast or not (`in_input_dtype`): CUDA's autocast would run layer_norm in fp32 (rms_norm too, in releases
whose autocast lists it; 2.11's does not: its fused RMSNorm kept bf16 inputs on the H100), copying a bf16 input
and bf16 parameters to fp32 and casting every gradient back, where the kernels read bf16 and accumulate in fp32
anyway. The recomputing norms of the split backward (below) are not changed (yet): they run as autocast has them.

When the schedule splits the backward into B and W (zero bubble), model/split_backward.py swaps each norm of a
built model for its `recomputed_norm`: torch's norm module whose forward runs through weight_grads.recomputed. It
keeps only the input and recomputes the norm in backward, for the input gradient in B and the weight's (and
bias's) in W, with the kernels of the module's own backward (apex is not used there). It holds the same
parameters under the same names, so checkpoints and module hooks (ZeRO-3's gathers) see nothing new.

What each keeps for backward (model/costs.py), over the residual stream's rows: LayerNorm its input, mean and
rstd; RMSNorm its input and rstd. How wide those are depends on the kernel: CUDA's fused kernels keep the input
as it came (LayerNorm under autocast without train.fusions runs in fp32: an fp32 copy) and fp32 statistics;
torch's composite RMSNorm (the CPU's) keeps an fp32 x and x * rstd. The recomputed norms keep only their input,
on any device.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from megalite.model.costs import MicroBatch
from megalite.parallel.weight_grads import recomputed


def _apex_norm(name: str):
    """The apex class `name` when NVIDIA apex is installed with its compiled extension and CUDA is usable.
    A Python-only apex build (or PyPI's unrelated `apex`) imports fine and fails at the first forward,
    so the extension itself must import."""
    if not torch.cuda.is_available():
        return None
    try:
        importlib.import_module("fused_layer_norm_cuda")
        return getattr(importlib.import_module("apex.normalization"), name)
    except (ImportError, AttributeError):
        return None


def build_norm(kind: str, hidden_size: int, eps: float, device: torch.device) -> nn.Module:
    """A `kind` ("layernorm" or "rmsnorm", model.norm) norm over the last dimension."""
    if kind == "layernorm":
        fused = _apex_norm("FusedLayerNorm") if device.type == "cuda" else None
        return fused(hidden_size, eps=eps) if fused else LayerNorm(hidden_size, eps=eps)
    fused = _apex_norm("FusedRMSNorm") if device.type == "cuda" else None
    return fused(hidden_size, eps=eps) if fused else RMSNorm(hidden_size, eps=eps)


def in_input_dtype(x: torch.Tensor, weight: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off around a norm whose input and weight share a dtype: the norm then runs in that dtype. On CUDA
    under bf16 autocast with bf16 parameters, layer_norm ran in fp32: three copies in (input, weight, bias), an
    fp32 output the next matmul cast back, and a cast of each gradient in backward (GPT-2 1.3B: 15 ms of a 299 ms
    step on an H200), where torch's kernel reads bf16, computes in fp32 and rounds its result once, as the cast
    after an fp32 norm did: the values are the same. fp32 parameters keep an fp32 residual stream, which autocast
    leaves as it is; a bf16 input under fp32 weights (a q/k norm of a bf16 projection) stays under autocast, since
    torch's CUDA norms take one dtype for input and weights. On a CPU autocast leaves norms alone: nothing
    changes there."""
    device = x.device.type
    if x.dtype == weight.dtype and torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


def output_width(batch: MicroBatch) -> int:
    """Bytes per element of a norm's output (and so of its gradient): fp32 from CUDA's kernels under autocast."""
    return 4 if batch.device == "cuda" and batch.autocast else batch.residual


def recomputed_held(elements: int, input_width: int, batch: MicroBatch) -> int:
    """A norm recomputed in W (the Recomputed* norms below): its input and its output gradient."""
    return elements * (input_width + output_width(batch))


class _Norm:
    """Costs of a norm over the residual stream's rows (the final norm, a layer's two)."""

    normalized_shape: tuple[int, ...]

    def _elements(self, batch: MicroBatch) -> int:
        return batch.rows * self.normalized_shape[-1]

    def held_bytes(self, batch: MicroBatch) -> int:
        return recomputed_held(self._elements(batch), batch.residual, batch)


class LayerNorm(_Norm, nn.LayerNorm):
    fused = True  # train.fusions (model/fused.py apply_fusions): in the input's dtype, or as autocast has it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with in_input_dtype(x, self.weight) if self.fused else contextlib.nullcontext():
            return super().forward(x)

    def saved_bytes(self, batch: MicroBatch) -> int:
        """Input (in its own dtype when fused; fp32 under CUDA's autocast otherwise), mean and rstd (fp32 on
        CUDA). The residual stream and the weights share the parameters' dtype, so a fused norm runs in it."""
        stats = 4 if batch.device == "cuda" else batch.residual
        width = batch.residual if self.fused else output_width(batch)
        return self._elements(batch) * width + 2 * batch.rows * stats


class RMSNorm(_Norm, nn.RMSNorm):
    fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with in_input_dtype(x, self.weight) if self.fused else contextlib.nullcontext():
            return super().forward(x)

    def saved_bytes(self, batch: MicroBatch) -> int:
        """CUDA's fused kernel: the input as it came and an fp32 rstd per row; torch's composite form (CPU): an
        fp32 x and x * rstd, and rstd."""
        width = batch.residual if batch.device == "cuda" else 2 * 4
        return self._elements(batch) * width + batch.rows * 4


class RecomputedLayerNorm(LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(_layer_norm, x, self.weight, self.bias, shape=tuple(self.normalized_shape), eps=self.eps)

    def saved_bytes(self, batch: MicroBatch) -> int:
        return self._elements(batch) * batch.residual


class RecomputedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(_rms_norm, x, self.weight, shape=tuple(self.normalized_shape), eps=self.eps)

    def saved_bytes(self, batch: MicroBatch) -> int:
        return self._elements(batch) * batch.residual


def recomputed_norm(norm: nn.Module) -> nn.Module | None:
    """The norm `norm` (one of build_norm's) as a Recomputed* module holding the same parameters; None for a
    module that is no such norm, or is one already."""
    if isinstance(norm, RecomputedLayerNorm | RecomputedRMSNorm):
        return None
    layer_norms = (nn.LayerNorm, *filter(None, [_apex_norm("FusedLayerNorm")]))
    rms_norms = (nn.RMSNorm, *filter(None, [_apex_norm("FusedRMSNorm")]))
    if isinstance(norm, layer_norms):
        recomputing = RecomputedLayerNorm(norm.normalized_shape, eps=norm.eps, device="meta")
        recomputing.weight, recomputing.bias = norm.weight, norm.bias
    elif isinstance(norm, rms_norms):
        recomputing = RecomputedRMSNorm(norm.normalized_shape, eps=norm.eps, device="meta")
        recomputing.weight = norm.weight
    else:
        return None
    return recomputing.train(norm.training)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, shape: tuple[int, ...],
                eps: float) -> torch.Tensor:
    return F.layer_norm(x, shape, weight, bias, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, *, shape: tuple[int, ...], eps: float | None) -> torch.Tensor:
    return F.rms_norm(x, shape, weight, eps)
