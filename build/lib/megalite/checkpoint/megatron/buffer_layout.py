"""Where each parameter lies in Megatron-LM's flat distributed-optimizer state (legacy `distrib_optim.pt`).

Megatron's distributed optimizer saves, per model chunk and buffer, the main weights and Adam's moments as
flat fp32 tensors over its gradient buffer, the buckets concatenated with each bucket's end padding removed
(`buckets_coalesced`; `numel_unpadded` elements). Its buffer lays the parameters out in reverse registration
order (the order gradients arrive in backward), each starting at a multiple of 64 elements; a new bucket
starts after `bucket_size` elements (none: one bucket) and around the tied embedding's copy, which gets a
bucket of its own (megatron/core/optimizer/distrib_optimizer.py `_compute_per_buffer_param_layout`). This
module repeats that rule; the caller checks the total against `numel_unpadded`, so a checkpoint laid out
otherwise is refused rather than misread.
"""

from __future__ import annotations

import math

ALIGN = 64


def flat_ranges(numels: list[tuple[str, int, bool]], bucket_size: int | None) -> tuple[dict[str, range], int]:
    """{name: its elements in the coalesced flat state}, and the state's total size, for parameters given in
    registration order as (name, numel, is the tied embedding's copy)."""
    where: dict[str, range] = {}
    base = pos = 0  # base: where the current bucket starts in the coalesced state; pos: offset inside it
    in_bucket = False
    for name, numel, shared in reversed(numels):
        pos = ALIGN * math.ceil(pos / ALIGN)
        if shared and in_bucket:
            base, pos, in_bucket = base + pos, 0, False
        where[name] = range(base + pos, base + pos + numel)
        pos, in_bucket = pos + numel, True
        if shared or (bucket_size is not None and pos >= bucket_size):
            base, pos, in_bucket = base + pos, 0, False
    return where, base + (pos if in_bucket else 0)


def bucket_size(args, pipeline_rank: int) -> int | None:
    """The bucket size Megatron's DDP used on this pipeline stage: buckets only with overlapped gradient
    reduction, and only on the first stage."""
    if not getattr(args, "overlap_grad_reduce", False) or pipeline_rank > 0:
        return None
    dp = args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                             * getattr(args, "context_parallel_size", 1))
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)
