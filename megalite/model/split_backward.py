"""The split backward, applied to a built model (as model/recompute.py applies activation recompute).

A schedule that splits each backward into B (input gradients) and W (weight gradients; ScheduleSpec.split_backward)
needs every weight gradient computed apart from the input gradient. Matmuls and lookups hand theirs over under
every schedule (weight_grads.py); the layers whose weight gradient autograd computes together with the input
gradient, norms and the bias a row-parallel layer adds after its reduction, keep only their input instead and
recompute themselves in backward (weight_grads.recomputed): the input gradient in B, the weight gradients in W.
That is a training choice, so it is made here, on the built model, not in its constructor: each norm is swapped
for its recomputing twin holding the same parameters (model/norms.py), each such bias flagged. Parameter names,
and with them checkpoints, stay the one-device ones.
"""

from __future__ import annotations

from torch import nn

from megalite.model.norms import recomputed_norm
from megalite.parallel.layers import RowParallelLinear


def apply_split_backward(model: nn.Module) -> None:
    """Make every weight gradient of `model` separable from its input gradient, in place (again: no change)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            swapped = recomputed_norm(child)
            if swapped is not None:
                setattr(parent, name, swapped)
            if isinstance(child, RowParallelLinear):
                child.recompute_bias = True
