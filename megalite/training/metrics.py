"""Where metrics go: a console line, a JSON-lines file, Weights & Biases and a progress bar.

Only the logging rank (the last rank, which sits on the last pipeline stage) writes, so
each logged step appears exactly once in every sink.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megalite.config import Config


def _format(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5) else f"{value:.4g}"
    return str(value)


class MetricsWriter:
    def __init__(self, cfg: Config, enabled: bool, start_step: int, wandb_run_id: str | None) -> None:
        self.enabled = enabled
        self.file = Path(cfg.logging.metrics_file) if enabled and cfg.logging.metrics_file else None
        if self.file:
            self.file.parent.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(total=cfg.train.train_iters, initial=start_step, unit="step", dynamic_ncols=True, disable=None) if enabled and cfg.logging.progress_bar else None
        self.wandb_run = self._init_wandb(cfg, wandb_run_id) if enabled else None

    @staticmethod
    def _init_wandb(cfg: Config, run_id: str | None):
        log = cfg.logging
        if not log.wandb_project or log.wandb_mode == "disabled":
            return None
        import wandb

        directory = Path(log.wandb_dir or cfg.checkpoint.save or ".")
        directory.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=log.wandb_project, entity=log.wandb_entity, name=log.wandb_name, mode=log.wandb_mode,
            config=cfg.to_dict(), dir=str(directory), id=run_id, resume="allow" if run_id else None,
        )

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run else None

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
        parts = [f"step {record['step']}"] + [f"{label} {_format(record.get(key))}" for key, label in console_keys.items()]
        self.print(" | ".join(parts))
        if self.file:
            with self.file.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.wandb_run:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def close(self, exit_code: int = 0) -> None:
        """Finish every sink once; a failed run is marked failed in W&B."""
        if self.bar:
            self.bar.close()
            self.bar = None
        if self.wandb_run:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
