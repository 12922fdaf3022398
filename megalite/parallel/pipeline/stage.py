"""Which layers each pipeline rank holds.

The layers are cut into pp * vp consecutive model chunks (global chunks 0 .. pp*vp-1). A chunk order gives
each rank its vp chunks:
- `LOOP` (Megatron-LM's interleaved assignment): rank r holds chunks r, r + pp, r + 2pp, ..., so
  activations always travel to the next rank around the ring;
- `V` (ZB-V, vp = 2): rank r holds chunks r and 2pp-1-r, so a micro batch runs down the ranks and back
  up: the last rank hands its first chunk's output to its own second chunk, and rank 0 holds both the
  first chunk (embedding) and the last (head and loss). Every rank then has the same work and, in ZB-V,
  the same activation memory (Qi et al., arXiv 2401.10241, section 6).
The schedule decides the order (its ScheduleSpec, spec.py). The first chunk also holds the embedding and the
last one the final norm, the LM head and the loss; `first_stage_layers` / `last_stage_layers` let those two
chunks hold fewer layers to balance that extra work. Checkpoints name layers by their global index, so a
model saved under one order loads under the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkOrder:
    """Which model chunks each pipeline rank holds, as its local chunks 0..vp-1; `vp`: the chunks per rank the
    order needs (None: any)."""

    name: str
    vp: int | None = None

    def global_chunk(self, pp: int, vp: int, rank: int, chunk: int) -> int:
        """The model chunk that rank `rank`'s local chunk `chunk` is."""
        raise NotImplementedError

    def holder(self, pp: int, vp: int, global_chunk: int) -> tuple[int, int]:
        """(pipeline rank, its local chunk) holding model chunk `global_chunk`."""
        raise NotImplementedError


class _Loop(ChunkOrder):
    def global_chunk(self, pp: int, vp: int, rank: int, chunk: int) -> int:
        return chunk * pp + rank

    def holder(self, pp: int, vp: int, global_chunk: int) -> tuple[int, int]:
        return global_chunk % pp, global_chunk // pp


class _V(ChunkOrder):
    def global_chunk(self, pp: int, vp: int, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * pp - 1 - rank

    def holder(self, pp: int, vp: int, global_chunk: int) -> tuple[int, int]:
        return (global_chunk, 0) if global_chunk < pp else (2 * pp - 1 - global_chunk, 1)


LOOP = _Loop("loop")
V = _V("v", vp=2)


@dataclass(frozen=True)
class PipelineStage:
    """Where a rank sits in the pipeline: its pipeline rank out of pp, holding vp model chunks in `order`.

    The one answer to "which global chunk is this, and who holds its neighbours", which the model
    (embedding, head), the schedule's message routing and the loss all ask; chunk is the rank's local
    index 0..vp-1. A schedule's spec builds the stages it runs on (ScheduleSpec.stage).
    """

    pp: int
    vp: int
    rank: int
    order: ChunkOrder = field(default=LOOP, kw_only=True)

    def __post_init__(self) -> None:
        if self.order.vp is not None and self.vp != self.order.vp:
            raise ValueError(f"the {self.order.name} chunk order holds {self.order.vp} chunks per rank, not "
                             f"vp={self.vp}")

    def global_chunk(self, chunk: int) -> int:
        """The model chunk that this rank's local chunk `chunk` is."""
        return self.order.global_chunk(self.pp, self.vp, self.rank, chunk)

    def holder(self, global_chunk: int) -> tuple[int, int]:
        """(pipeline rank, its local chunk) holding model chunk `global_chunk`."""
        return self.order.holder(self.pp, self.vp, global_chunk)

    @property
    def model_chunks(self) -> int:
        """Model chunks in the whole pipeline."""
        return self.pp * self.vp

    @property
    def head_rank(self) -> int:
        """The pipeline rank holding the last chunk: the LM head, and the loss."""
        return self.holder(self.model_chunks - 1)[0]

    @property
    def has_embedding(self) -> bool:
        return self.holder(0)[0] == self.rank

    @property
    def has_head(self) -> bool:
        return self.head_rank == self.rank

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
    def of(cls, stage: PipelineStage, num_layers: int, first: int | None = None,
           last: int | None = None) -> StageLayout:
        """`stage` with its chunks' layers: `num_layers` cut as chunk_layer_counts cuts them."""
        counts = chunk_layer_counts(num_layers, stage.model_chunks, first, last)
        starts = [sum(counts[:g]) for g in range(stage.model_chunks)]
        mine = [stage.global_chunk(chunk) for chunk in range(stage.vp)]
        return cls(stage.pp, stage.vp, stage.rank, tuple((starts[g], starts[g] + counts[g]) for g in mine),
                   order=stage.order)

    @classmethod
    def single(cls, num_layers: int) -> StageLayout:
        """The whole model on one rank (no pipeline parallelism)."""
        return cls(1, 1, 0, ((0, num_layers),))


def chunk_layer_counts(num_layers: int, chunks: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per global chunk; raises ValueError (with the fix) when they cannot be split evenly
    (config validation reports it as a config error)."""
    fixed = {0: first, chunks - 1: last} if chunks > 1 else {}
    fixed = {i: n for i, n in fixed.items() if n is not None}
    middle = chunks - len(fixed)
    rest = num_layers - sum(fixed.values())
    if any(n < 1 for n in fixed.values()) or rest < middle or (middle and rest % middle) or (not middle and rest):
        raise ValueError(
            f"cannot split {num_layers} layers into {chunks} pipeline chunks (pp * vp) with "
            f"first_stage_layers={first}, last_stage_layers={last}: every chunk needs >= 1 layer and the remaining "
            "chunks an equal share"
        )
    share = rest // middle if middle else 0
    return [fixed.get(i, share) for i in range(chunks)]
