"""Where each parameter lies in Megatron-LM's flat distributed-optimizer state.

Megatron's distributed optimizer keeps the main weights and Adam's moments flat over its gradient buffers: one
buffer per model chunk (and parameter dtype; experts, when split over ep or a different etp, in buffers of their
own), cut into buckets. A buffer lays its parameters out in reverse registration order (the order gradients
arrive in backward), each starting at a multiple of 64 elements; a bucket closes once it holds `bucket_size`
elements (none: one bucket per buffer) and around the tied embedding's copy, which gets a bucket of its own, the
bucket before it closing at that copy's padded start; each bucket's end is then padded to a multiple of
lcm(dp, 128), which moves nothing inside the next bucket, as its start stays a multiple of 64
(megatron/core/optimizer/distrib_optimizer.py `_compute_per_buffer_param_layout`).

The legacy format (`distrib_optim.pt`) saves each buffer's buckets concatenated without their end padding
(`buckets_coalesced`); torch_dist's default (`dp_reshardable`) saves each bucket as a tensor of its unpadded size
and records every bucket's size, so bucket boundaries come from the checkpoint, and the legacy format's from
Megatron's bucket-size rule. Anything that does not add up is refused, naming the parameter and the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """A parameter's place: its bucket and its elements in that bucket's unpadded state."""

    bucket: int
    span: range


@dataclass(frozen=True)
class Param:
    """A parameter of one buffer as Megatron registered it: name, elements, and whether it is the tied
    embedding's copy under pipeline parallelism (Megatron's `shared_embedding`)."""

    name: str
    numel: int
    shared: bool = False


def _closes(pos: int, size: int | None, sizes: list[int] | None, bucket: int, name: str, where: str) -> bool:
    """Whether the bucket closes after a parameter ending at `pos`: at the recorded size, or past Megatron's
    `bucket_size` (legacy, no sizes recorded)."""
    if sizes is None:
        return size is not None and pos >= size
    if bucket >= len(sizes) or pos > sizes[bucket]:
        recorded = sizes[bucket] if bucket < len(sizes) else "none"
        raise ValueError(f"{where}: {name} ends at element {pos} of bucket {bucket}, whose recorded size is "
                         f"{recorded} (buckets {sizes}): the parameters do not lay out as Megatron's buffer")
    return pos == sizes[bucket]


def bucket_slots(params: list[Param], where: str, sizes: list[int] | None = None,
                 bucket_size: int | None = None) -> tuple[dict[str, Slot], list[int]]:
    """{name: Slot} for a buffer's parameters (in registration order), and each bucket's unpadded size. `sizes`:
    the buckets' unpadded sizes the checkpoint recorded (checked: every bucket must close on them); otherwise
    Megatron's `bucket_size` decides."""
    slots: dict[str, Slot] = {}
    closed: list[int] = []
    pos = 0  # offset inside the open bucket; 0 and no slot in it: no bucket open
    for param in reversed(params):
        pos = ALIGN * math.ceil(pos / ALIGN)
        if param.shared and pos:
            if sizes is not None and (len(closed) >= len(sizes) or sizes[len(closed)] != pos):
                raise ValueError(f"{where}: the bucket before the tied embedding's copy {param.name} should close at "
                                 f"{pos} elements, the checkpoint records buckets {sizes}")
            closed.append(pos)
            pos = 0
        slots[param.name] = Slot(len(closed), range(pos, pos + param.numel))
        pos += param.numel
        if param.shared or _closes(pos, bucket_size, sizes, len(closed), param.name, where):
            closed.append(pos)
            pos = 0
    if pos:
        closed.append(pos)
    if sizes is not None and closed != sizes:
        raise ValueError(f"{where}: the parameters lay out as buckets of {closed} elements, the checkpoint records "
                         f"{sizes}: this buffer holds other parameters than megalite expects")
    return slots, closed


def coalesced(slots: dict[str, Slot], sizes: list[int]) -> dict[str, range]:
    """Each parameter's elements in the legacy format's state: the buckets concatenated without end padding."""
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    return {name: range(starts[s.bucket] + s.span.start, starts[s.bucket] + s.span.stop) for name, s in slots.items()}


def bucket_size(args, pipeline_rank: int, chunk: int = 0) -> int | None:
    """The bucket size Megatron's DDP used for a model chunk on a pipeline stage: buckets only with overlapped
    gradient reduction, and only on the first stage's first chunk (megatron/training/training.py `get_model`)."""
    if (not getattr(args, "overlap_grad_reduce", False) or pipeline_rank > 0 or chunk > 0
            or getattr(args, "overlap_param_gather_with_optimizer_step", False)):
        return None
    if getattr(args, "ddp_num_buckets", None):
        raise ValueError(f"args.ddp_num_buckets={args.ddp_num_buckets}: the legacy format does not record the "
                         "bucket sizes this gave; convert with --no-optimizer to carry the weights only")
    dp = args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                             * getattr(args, "context_parallel_size", 1))
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)
