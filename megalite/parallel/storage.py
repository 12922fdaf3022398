"""Freeing and re-growing a tensor's storage in place: how megalite gives back memory that views still point at.

ZeRO-3 frees a bucket's gathered parameters between uses (zero/stage3.py) and the pipeline frees an activation
once it is sent (pipeline/executor.py) by resizing the storage to zero bytes: the tensors viewing it (the parameters,
what autograd saved) keep their shapes, and see memory again once it is re-grown. It goes through torch's
operator for this (`inductor.resize_storage_bytes_`, which FSDP2 uses under torch.compile), not the storage's
`resize_` method, so that it is an operation like any other for a dispatch mode: the dry run's byte counter
(dryrun/live_bytes.py) sees every resize, on real tensors as on fake ones, without patching torch.
"""

from __future__ import annotations

import torch

RESIZE = torch.ops.inductor.resize_storage_bytes_.default


@torch.compiler.disable
def resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give `tensor`'s storage `nbytes` bytes (0 frees it; growing it leaves the contents undefined). Eager even
    inside a compiled layer (train.compile: ZeRO-3's gathers and frees run in its module hooks): inductor lowers
    this operator only for sizes known when compiling, and a bucket's size is a symbol there."""
    RESIZE(tensor, nbytes)
