"""The pipeline bubble of a schedule: its formula (registered with the schedule, parallel/schedules.py) and its
op lists played out with given operation times.

`simulated_step` runs every rank's list as the executor would with free, instant messages: an operation starts
when its rank is free and its input exists (the previous chunk's forward, the next chunk's backward, its own
B for a W). What the lists alone cost, before any communication: tests hold the formulas to it, and the
pipeline benchmark (tools/benchmark_pipeline.py) compares measured steps with both.
"""

from __future__ import annotations

from megalite.parallel.pipeline_layout import PipelineStage, placement_of
from megalite.parallel.schedules import B, F, Op, schedule_ops, splits_backward


def _dependency(stage: PipelineStage, op: Op) -> tuple[str, int, int, int] | None:
    """(kind, rank, chunk, micro batch) of the operation `op` waits for, or None."""
    kind, chunk, mb = op
    g = stage.global_chunk(chunk)
    if kind == F:
        return None if g == 0 else (F, *stage.holder(g - 1), mb)
    if kind == B:
        return (F, stage.rank, chunk, mb) if g == stage.model_chunks - 1 else (B, *stage.holder(g + 1), mb)
    return B, stage.rank, chunk, mb


def simulated_step(name: str, pp: int, vp: int, microbatches: int, t_f: float = 1.0, t_b: float = 1.0,
                   t_w: float = 1.0) -> float:
    """The step time of schedule `name` with a rank's forward, input-gradient and weight-gradient times t_f, t_b,
    t_w (its whole stage: each chunk takes 1/vp of them); a schedule without W runs B and W as one backward."""
    if not splits_backward(name):
        t_b, t_w = t_b + t_w, 0.0
    stages = [PipelineStage(pp, vp, r, placement=placement_of(name)) for r in range(pp)]
    ops = [schedule_ops(name, pp, vp, r, microbatches) for r in range(pp)]
    took = {F: t_f / vp, B: t_b / vp, "W": t_w / vp}
    done: dict[tuple[str, int, int, int], float] = {}
    position, clock = [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r, stage in enumerate(stages):
            while position[r] < len(ops[r]):
                op = ops[r][position[r]]
                needed = _dependency(stage, op)
                if needed is not None and needed not in done:
                    break
                clock[r] = max(clock[r], done[needed] if needed else 0.0) + took[op.kind]
                done[(op.kind, r, op.chunk, op.microbatch)] = clock[r]
                position[r], progress = position[r] + 1, True
    if position != [len(o) for o in ops]:
        raise RuntimeError(f"schedule {name} (pp={pp}, vp={vp}, {microbatches} micro batches) cannot finish")
    return max(clock)


def simulated_bubble(name: str, pp: int, vp: int, microbatches: int, t_f: float = 1.0, t_b: float = 1.0,
                     t_w: float = 1.0) -> float:
    """`simulated_step`'s idle share of the ideal step m (t_f + t_b + t_w), as `bubble_fraction` gives it."""
    ideal = microbatches * (t_f + t_b + t_w)
    return simulated_step(name, pp, vp, microbatches, t_f, t_b, t_w) / ideal - 1

