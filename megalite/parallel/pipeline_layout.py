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

from megalite.config import chunk_layer_counts

if TYPE_CHECKING:
    from megalite.config import Config


@dataclass(frozen=True)
class PipelineStage:
    """Where a rank sits in the pipeline: its pipeline rank out of pp, holding vp model chunks.

    The one answer to "does this chunk start or end the model", which the model (embedding, head),
    the schedule's message routing and the loss all ask; chunk is the rank's local index 0..vp-1.
    """

    pp: int
    vp: int
    rank: int

    @property
    def has_embedding(self) -> bool:
        return self.rank == 0

    @property
    def has_head(self) -> bool:
        return self.rank == self.pp - 1

    def is_first_chunk(self, chunk: int) -> bool:
        """The model's first chunk: it embeds the tokens and receives no activation."""
        return self.has_embedding and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        """The model's last chunk: it computes the loss and receives no gradient."""
        return self.has_head and chunk == self.vp - 1


@dataclass(frozen=True)
class StageLayout(PipelineStage):
    """A pipeline stage with the layers of its model chunks: global layer ranges in schedule order."""

    chunks: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.chunks) != self.vp:
            raise ValueError(f"pipeline rank {self.rank} has {len(self.chunks)} layer ranges for vp={self.vp} chunks")

    @classmethod
    def for_rank(cls, num_layers: int, pp: int, vp: int, rank: int, first: int | None = None,
                 last: int | None = None) -> StageLayout:
        counts = chunk_layer_counts(num_layers, pp * vp, first, last)
        starts = [sum(counts[:g]) for g in range(pp * vp)]
        mine = [rank + k * pp for k in range(vp)]
        return cls(pp, vp, rank, tuple((starts[g], starts[g] + counts[g]) for g in mine))

    @classmethod
    def single(cls, num_layers: int) -> StageLayout:
        """The whole model on one rank (no pipeline parallelism)."""
        return cls(1, 1, 0, ((0, num_layers),))


def stage_layout(cfg: Config, pp_rank: int) -> StageLayout:
    """Pipeline rank `pp_rank`'s layout as the config asks (the whole model when parallel.pp = 1)."""
    p = cfg.parallel
    if p.pp == 1:
        return StageLayout.single(cfg.model.num_layers)
    return StageLayout.for_rank(cfg.model.num_layers, p.pp, p.vp, pp_rank, p.first_stage_layers, p.last_stage_layers)
