"""Where metrics go: a console line, a JSON-lines file, Weights & Biases and a progress bar.

Only the logging rank (the last rank, which sits on the last pipeline stage) writes, so
each logged step appears exactly once in every sink. W&B runs in a process of its own
(wandb_logger.py), so it can neither stop nor stall training.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megalite.config import Config
from megalite.config_resolved import resolved_config
from megalite.training.wandb_logger import WandbLogger

DURATIONS = ("elapsed_s", "eta_s")  # seconds, shown as 1h02m03s


def format_duration(seconds: float) -> str:
    """12.3s, 4m05s or 1h02m03s: durations as a log reader takes them in at a glance."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _format(value: Any, key: str = "") -> str:
    if value is None:
        return "n/a"
    if key in DURATIONS:
        return format_duration(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5) else f"{value:.4g}"
    return str(value)


def _step_of(line: str) -> int | None:
    """The step of one whole line of the metrics file; None for a line cut short or not a record."""
    try:
        record = json.loads(line) if line.endswith("\n") else None
    except json.JSONDecodeError:
        return None
    return record.get("step") if isinstance(record, dict) else None


def wandb_enabled(cfg: Config) -> bool:
    return bool(cfg.logging.wandb_project) and cfg.logging.wandb_mode != "disabled"


class MetricsWriter:
    """`wandb_run_id`: the W&B run to log to (every rank agrees on it; a resumed run passes the saved one)."""

    def __init__(self, cfg: Config, enabled: bool, start_step: int, wandb_run_id: str | None) -> None:
        self.enabled, self.total = enabled, cfg.train.train_iters
        self.file = Path(cfg.logging.metrics_file) if enabled and cfg.logging.metrics_file else None
        self.file_lock = threading.Lock()  # the W&B supervisor notes a fallback from its own thread
        if self.file:
            self.file.parent.mkdir(parents=True, exist_ok=True)
        self.bar = (tqdm(total=cfg.train.train_iters, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=None)
                    if enabled and cfg.logging.progress_bar else None)
        self._continue_file_at(start_step)  # before W&B, which may note a fallback in the file
        self.wandb = (self._start_wandb(cfg, wandb_run_id, start_step)
                      if enabled and wandb_enabled(cfg) and wandb_run_id else None)
        self.wandb_dir: str | None = None

    def _continue_file_at(self, step: int) -> None:
        """The metrics file continues at the step this run starts from: records that a stopped or killed run
        wrote after it (and a line cut short by a kill) are dropped, as this run writes those steps again, so
        every step appears once. Rewritten atomically; one line says what went."""
        if not self.file or not self.file.exists():
            return
        lines = self.file.read_text().splitlines(keepends=True)
        kept = [line for line in lines if (logged := _step_of(line)) is not None and logged <= step]
        if len(kept) == len(lines):
            return
        tmp = self.file.with_name(self.file.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.file)
        self.print(f"metrics file {self.file}: dropped {len(lines) - len(kept)} records after step {step}, "
                   "written by a run that got further than its last checkpoint; this run writes those steps again")

    def _start_wandb(self, cfg: Config, run_id: str, start_step: int) -> WandbLogger:
        log = cfg.logging
        directory = Path(log.wandb_dir or cfg.checkpoint.save or ".")
        directory.mkdir(parents=True, exist_ok=True)
        settings = {"project": log.wandb_project, "entity": log.wandb_entity, "name": log.wandb_name,
                    "config": resolved_config(cfg).to_dict(), "dir": str(directory), "id": run_id, "resume": "allow"}
        return WandbLogger(settings, log.wandb_mode, log.wandb_timeout, self.print, self.note, start_step)

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar:
            self.bar.update(steps)

    def log(self, record: dict[str, Any], console_keys: dict[str, str]) -> None:
        """Write `record` (must hold `step`) to every sink; `console_keys` maps record keys to console labels."""
        if not self.enabled:
            return
        parts = [f"step {record['step']}/{self.total}"] + [f"{label} {_format(record.get(key), key)}"
                                                           for key, label in console_keys.items()]
        self.print(" | ".join(parts))
        self.note(record)
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, record["step"])

    def note(self, record: dict[str, Any]) -> None:
        """Append one record to the metrics file."""
        if self.file:
            with self.file_lock, self.file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self, exit_code: int = 0) -> None:
        """Finish every sink once; a failed run is marked failed in W&B."""
        if self.bar:
            self.bar.close()
            self.bar = None
        if self.wandb:
            self.wandb_dir = self.wandb.close(exit_code)
            self.wandb = None
