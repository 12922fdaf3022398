"""Which layers each pipeline rank holds.

The layers are cut into pp * vp consecutive model chunks; rank r holds chunks r, r + pp,
r + 2pp, ... (Megatron-LM's interleaved assignment), so activations always travel to the
next rank around the ring. The first chunk also holds the embedding and the last one the
final norm, the LM head and the loss; `first_stage_layers` / `last_stage_layers` let those
two chunks hold fewer layers to balance that extra work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config import Config


def chunk_layer_counts(num_layers: int, chunks: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per global chunk; raises ValueError (with the fix) when they cannot be split evenly."""
    fixed = {0: first, chunks - 1: last} if chunks > 1 else {}
    fixed = {i: n for i, n in fixed.items() if n is not None}
    middle = chunks - len(fixed)
    rest = num_layers - sum(fixed.values())
    if any(n < 1 for n in fixed.values()) or rest < middle or (middle and rest % middle) or (not middle and rest):
        raise ValueError(
            f"cannot split {num_layers} layers into {chunks} pipeline chunks (pp * vp) with first_stage_layers={first}, "
            f"last_stage_layers={last}: every chunk needs >= 1 layer and the remaining chunks an equal share"
        )
    share = rest // middle if middle else 0
    return [fixed.get(i, share) for i in range(chunks)]


@dataclass(frozen=True)
class StageLayout:
    """The model chunks of one pipeline rank: global layer ranges in schedule order."""

    chunks: tuple[tuple[int, int], ...]
    has_embedding: bool
    has_head: bool

    @classmethod
    def for_rank(cls, num_layers: int, pp: int, vp: int, rank: int, first: int | None = None, last: int | None = None) -> "StageLayout":
        counts = chunk_layer_counts(num_layers, pp * vp, first, last)
        starts = [sum(counts[:g]) for g in range(pp * vp)]
        mine = [rank + k * pp for k in range(vp)]
        return cls(tuple((starts[g], starts[g] + counts[g]) for g in mine), rank == 0, rank == pp - 1)

    @classmethod
    def single(cls, num_layers: int) -> "StageLayout":
        return cls(((0, num_layers),), True, True)

    def is_first_chunk(self, chunk: int) -> bool:
        return self.has_embedding and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.has_head and chunk == len(self.chunks) - 1


def stage_layout(cfg: "Config", pp_rank: int) -> StageLayout:
    """Pipeline rank `pp_rank`'s layout as the config asks (the whole model when parallel.pp = 1)."""
    p = cfg.parallel
    if p.pp == 1:
        return StageLayout.single(cfg.model.num_layers)
    return StageLayout.for_rank(cfg.model.num_layers, p.pp, p.vp, pp_rank, p.first_stage_layers, p.last_stage_layers)
