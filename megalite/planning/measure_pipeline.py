"""Measuring a pipeline stage: its forward, input-gradient and weight-gradient times, and the activation memory a
schedule holds on a rank, as the planner counts it (planning/memory.py peak_activations).

Why here and not in the tool: tools/benchmark_pipeline.py reports these beside the planner's figures, and
tests hold the planner to the same measurement (planning/measure.py says why measurements have one home).

Activation memory at a schedule's peak: after every operation of a real training step, the bytes of the
distinct storages that autograd saved and that are still alive, plus those the queued weight gradients hold
for their W (measure.held_for_w), parameters left out; the most at any operation's end (and at the end of
either part of a paired F&B). Inside an operation a backward also holds its own temporaries; the planner
counts those as transient, apart.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from megalite.config import Config
from megalite.data.mtp_targets import mtp_targets
from megalite.model.split_backward import apply_split_backward
from megalite.parallel.context import ParallelContext
from megalite.parallel.pipeline.executor import InFlight, ScheduleObserver
from megalite.parallel.pipeline.ops import Op, ScheduleOp
from megalite.parallel.weight_grads import WeightGradients, deferred
from megalite.planning.measure import held_for_w
from megalite.training.build import Trainer, build_model
from megalite.training.step import precision_context


def stage_times(cfg: Config, pp_rank: int, repeats: int = 7) -> tuple[float, float, float]:
    """Median seconds of pipeline rank `pp_rank`'s forward (all its chunks, one micro batch, from a random input),
    its B and its W, built as a zero-bubble schedule builds it, on this process's CPU threads."""
    model = build_model(cfg, torch.device("cpu"), ParallelContext(), pp_rank).train()
    apply_split_backward(model)
    shape = (cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size)
    tokens = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.long)
    depths = cfg.model.mtp_num_layers  # the head's stage runs multi-token prediction too
    targets = mtp_targets(tokens, torch.ones(tokens.shape), None, depths) if depths else None
    times: list[tuple[float, float, float]] = []
    for _ in range(repeats + 1):
        marks = [time.perf_counter()]
        outputs = []
        with precision_context(cfg.train.precision, torch.device("cpu")):
            for chunk in range(model.stage.vp):
                hidden = None if model.stage.is_first_chunk(chunk) else torch.randn(shape, requires_grad=True)
                out = model(tokens, tokens, hidden=hidden, chunk=chunk, mtp=targets)
                outputs.append(out.float().sum() if model.stage.is_last_chunk(chunk) else out.float().square().sum())
        marks.append(time.perf_counter())
        queue = WeightGradients()
        with deferred(queue):
            torch.autograd.backward(outputs)
        marks.append(time.perf_counter())
        queue.run()
        marks.append(time.perf_counter())
        times.append((marks[1] - marks[0], marks[2] - marks[1], marks[3] - marks[2]))
    return tuple(statistics.median(t[kind] for t in times[1:]) for kind in range(3))


class ActivationPeak(ScheduleObserver):
    """While `tracking(trainer)`: the bytes saved for backward and held for W, sampled after every schedule
    operation of the trainer's steps."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.saved: dict[int, weakref.ref] = {}
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.saved[storage.data_ptr()] = weakref.ref(storage)
        return tensor

    def sample(self, queues: list[WeightGradients]) -> None:
        alive = {}
        for ptr, ref in list(self.saved.items()):
            storage = ref()
            if storage is None or storage.nbytes() == 0 or storage.data_ptr() != ptr:
                del self.saved[ptr]
            else:
                alive[ptr] = storage.nbytes()
        for queue in queues:
            alive |= held_for_w(queue, [])
        self.peak = max(self.peak, sum(size for ptr, size in alive.items() if ptr not in self.skip))

    def after(self, op: ScheduleOp, in_flight: InFlight) -> None:
        self.sample(in_flight.weight_work)

    def after_part(self, part: Op, in_flight: InFlight) -> None:
        """A pair's forward part holds its activations before its backward part frees the other's."""
        self.sample(in_flight.weight_work)

    @contextlib.contextmanager
    def tracking(self, trainer: Trainer) -> Iterator[ActivationPeak]:
        trainer.pipeline.observers.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            trainer.pipeline.observers.remove(self)


def activation_peak(trainer: Trainer, step: Callable[[], object]) -> int:
    """The peak of `ActivationPeak` over `step()`, one training step of `trainer`."""
    peak = ActivationPeak(list(trainer.model.parameters()))
    with peak.tracking(trainer):
        step()
    return peak.peak
