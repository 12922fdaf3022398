"""Which layers each pipeline rank holds.

The layers are cut into pp * vp consecutive model chunks (global chunks 0 .. pp*vp-1). Two placements
give each rank its vp chunks:
- "loop" (Megatron-LM's interleaved assignment): rank r holds chunks r, r + pp, r + 2pp, ..., so
  activations always travel to the next rank around the ring;
- "v" (ZB-V, vp = 2): rank r holds chunks r and 2pp-1-r, so a micro batch runs down the ranks and back
  up: the last rank hands its first chunk's output to its own second chunk, and rank 0 holds both the
  first chunk (embedding) and the last (head and loss). Every rank then has the same work and, in ZB-V,
  the same activation memory (Qi et al., arXiv 2401.10241, section 6).
The schedule decides the placement (`PLACEMENTS`). The first chunk also holds the embedding and the last
one the final norm, the LM head and the loss; `first_stage_layers` / `last_stage_layers` let those two
chunks hold fewer layers to balance that extra work. Checkpoints name layers by their global index, so a
model saved under one placement loads under the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megalite.config import chunk_layer_counts

if TYPE_CHECKING:
    from megalite.config import Config

PLACEMENTS = {"zb-v": "v"}  # schedules that place chunks in a V; every other schedule loops


def placement_of(schedule: str) -> str:
    """The chunk placement schedule `schedule` runs on: "v" or "loop"."""
    return PLACEMENTS.get(schedule, "loop")


@dataclass(frozen=True)
class PipelineStage:
    """Where a rank sits in the pipeline: its pipeline rank out of pp, holding vp model chunks.

    The one answer to "which global chunk is this, and who holds its neighbours", which the model
    (embedding, head), the schedule's message routing and the loss all ask; chunk is the rank's local
    index 0..vp-1.
    """

    pp: int
    vp: int
    rank: int
    placement: str = field(default="loop", kw_only=True)

    def __post_init__(self) -> None:
        if self.placement not in ("loop", "v"):
            raise ValueError(f"unknown chunk placement {self.placement!r}; it is 'loop' or 'v'")
        if self.placement == "v" and self.vp != 2:
            raise ValueError(f"the V placement holds two chunks per rank, not vp={self.vp}")

    def global_chunk(self, chunk: int) -> int:
        """The model chunk that this rank's local chunk `chunk` is."""
        if self.placement == "v":
            return self.rank if chunk == 0 else 2 * self.pp - 1 - self.rank
        return chunk * self.pp + self.rank

    def holder(self, global_chunk: int) -> tuple[int, int]:
        """(pipeline rank, its local chunk) holding model chunk `global_chunk`."""
        if self.placement == "v":
            return (global_chunk, 0) if global_chunk < self.pp else (2 * self.pp - 1 - global_chunk, 1)
        return global_chunk % self.pp, global_chunk // self.pp

    @property
    def model_chunks(self) -> int:
        """Model chunks in the whole pipeline."""
        return self.pp * self.vp

    @property
    def has_embedding(self) -> bool:
        return self.holder(0)[0] == self.rank

    @property
    def has_head(self) -> bool:
        return self.holder(self.model_chunks - 1)[0] == self.rank

    @property
    def shares_embedding(self) -> bool:
        """The LM head and the embedding are in one chunk (no pipeline): a tied head reads the embedding's
        weight itself. Otherwise the head's stage holds a copy (under ZB-V, rank 0 holds both chunks)."""
        return self.model_chunks == 1

    def is_first_chunk(self, chunk: int) -> bool:
        """The model's first chunk: it embeds the tokens and receives no activation."""
        return self.global_chunk(chunk) == 0

    def is_last_chunk(self, chunk: int) -> bool:
        """The model's last chunk: it computes the loss and receives no gradient."""
        return self.global_chunk(chunk) == self.model_chunks - 1


@dataclass(frozen=True)
class StageLayout(PipelineStage):
    """A pipeline stage with the layers of its model chunks: global layer ranges in schedule order."""

    chunks: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.chunks) != self.vp:
            raise ValueError(f"pipeline rank {self.rank} has {len(self.chunks)} layer ranges for vp={self.vp} chunks")

    @classmethod
    def for_rank(cls, num_layers: int, pp: int, vp: int, rank: int, first: int | None = None,
                 last: int | None = None, placement: str = "loop") -> StageLayout:
        counts = chunk_layer_counts(num_layers, pp * vp, first, last)
        starts = [sum(counts[:g]) for g in range(pp * vp)]
        stage = PipelineStage(pp, vp, rank, placement=placement)
        mine = [stage.global_chunk(chunk) for chunk in range(vp)]
        return cls(pp, vp, rank, tuple((starts[g], starts[g] + counts[g]) for g in mine), placement=placement)

    @classmethod
    def single(cls, num_layers: int) -> StageLayout:
        """The whole model on one rank (no pipeline parallelism)."""
        return cls(1, 1, 0, ((0, num_layers),))


def stage_layout(cfg: Config, pp_rank: int) -> StageLayout:
    """Pipeline rank `pp_rank`'s layout as the config asks (the whole model when parallel.pp = 1)."""
    p = cfg.parallel
    if p.pp == 1:
        return StageLayout.single(cfg.model.num_layers)
    return StageLayout.for_rank(cfg.model.num_layers, p.pp, p.vp, pp_rank, p.first_stage_layers,
                                p.last_stage_layers, placement_of(p.pipeline_schedule))
