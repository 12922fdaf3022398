"""Profile chosen training steps on chosen ranks, and dump CUDA memory history for OOM hunts.

Why here and not in the loop: the training loop should only say when a step starts and ends;
this object decides whether that step is profiled. `logging.profile_steps=[a, b]` records steps
a..b (inclusive) with torch.profiler on every rank in `logging.profile_ranks` (default [0]) and
writes, per rank, a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing; the
.pt.trace.json name is also what TensorBoard's PyTorch profiler plugin looks for) and a table
of the operators that took most time. Each step is marked as a "megalite step N" range.
`logging.memory_snapshot=PATH` records the CUDA caching allocator's history from start-up (so
model build and optimizer state are in it) and dumps it after the profiled steps (step 2
without them) or at close, also when the run dies of an out-of-memory error; open the pickle at
https://pytorch.org/memory_viz. On CPUs there is no allocator history: a notice says so once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megalite.config import ConfigError, LoggingConfig
from megalite.config_validation import profile_config_errors, profile_ranks

_SNAPSHOT_ENTRIES = 100_000  # allocation events kept (the oldest are dropped beyond this)


class Profiler:
    """Call step_started(step) / step_finished(step) around every training step and close() at the
    end of the run (also after an error); it does nothing on ranks and steps not asked for."""

    def __init__(self, cfg: LoggingConfig, rank: int, device: torch.device) -> None:
        ConfigError.raise_if(profile_config_errors(cfg))
        self.rank, self.device = rank, device
        chosen = rank in profile_ranks(cfg)
        self.steps = cfg.profile_steps if chosen else None
        self.directory = Path(cfg.profile_dir)
        self.profiler: profile | None = None
        self.step_range: record_function | None = None
        self.recorded: list[int] = []
        self.snapshot = cfg.memory_snapshot.replace("{rank}", str(rank)) if chosen and cfg.memory_snapshot else None
        self.snapshot_after = cfg.profile_steps[1] if cfg.profile_steps else 2
        if self.snapshot and device.type != "cuda":
            print(f"rank {rank}: logging.memory_snapshot needs a CUDA device and this run is on {device.type}: "
                  "no snapshot will be written (logging.profile_steps still records CPU time)", file=sys.stderr,
                  flush=True)
            self.snapshot = None
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES)

    def step_started(self, step: int) -> None:
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return
        if self.profiler is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.start()
        self.step_range = record_function(f"megalite step {step}")
        self.step_range.__enter__()
        self.recorded.append(step)

    def step_finished(self, step: int) -> None:
        self._end_step_range()
        if self.profiler is not None and step >= self.steps[1]:
            self._write_trace()
        if self.snapshot and step >= self.snapshot_after:
            self._dump_snapshot()

    def close(self) -> None:
        """Write what was recorded so far: a run that stops early or fails still leaves its files."""
        self._end_step_range()
        if self.profiler is not None:
            self._write_trace()
        if self.snapshot:
            self._dump_snapshot()

    def _end_step_range(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _write_trace(self) -> None:
        self.profiler.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"rank{self.rank}_steps{self.recorded[0]}-{self.recorded[-1]}"
        self.profiler.export_chrome_trace(f"{stem}.pt.trace.json")
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        Path(f"{stem}.txt").write_text(self.profiler.key_averages().table(sort_by=sort_by, row_limit=30))
        print(f"rank {self.rank}: profile of steps {self.recorded[0]}-{self.recorded[-1]} written to "
              f"{stem}.pt.trace.json (open in https://ui.perfetto.dev) and {stem}.txt", file=sys.stderr, flush=True)
        self.profiler, self.steps = None, None

    def _dump_snapshot(self) -> None:
        path = Path(self.snapshot)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"rank {self.rank}: CUDA memory history written to {path} (open in https://pytorch.org/memory_viz)",
              file=sys.stderr, flush=True)
        self.snapshot = None
