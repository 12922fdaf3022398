"""What a run says about itself in a log file: the start-up summary (parameters, the planner's memory estimate
on a GPU), progress figures for every log line (step N/total, seconds per step,
elapsed, ETA) and the end-of-run summary. A cluster user reads these in a file, where no progress bar shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megalite.config import Config
from megalite.config_fp8 import fp8_layer_numbers
from megalite.parallel.topology import device_memory
from megalite.planning.memory import memory_per_stage
from megalite.planning.parameters import active_parameters, model_parameters, rank_parameters
from megalite.training.metrics import format_duration


def _millions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def parameters_line(cfg: Config) -> str:
    """The whole model's parameter count (one copy, as one device holds it) and each rank's share: the same on
    every pipeline stage's tensor- and expert-parallel ranks (before ZeRO-3 shards them further)."""
    m, p = cfg.model, cfg.parallel
    total = model_parameters(m)
    active = f" ({_millions(active_parameters(m))} active per token)" if m.num_experts else ""
    stages = [rank_parameters(cfg, rank).total for rank in range(p.pp)]
    split = ", ".join(f"{axis} {size}" for axis, size in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep)) if size > 1)
    if len(set(stages)) == 1:
        per_rank = _millions(stages[0])
    else:
        per_rank = ", ".join(f"{_millions(n)} (stage {rank})" for rank, n in enumerate(stages))
    zero3 = "; ZeRO-3 keeps 1/dp of them between uses" if p.zero >= 3 else ""
    return (f"parameters: {_millions(total)} in the model{active} (padded vocabulary {m.padded_vocab_size}); "
            f"per rank{f' ({split})' if split else ''}: {per_rank}{zero3}")


def fp8_line(cfg: Config) -> str | None:
    """Whether FP8 is on, with which recipe, in which layers, and what stays in the compute precision
    (build_model applies it)."""
    t, layers = cfg.train, cfg.model.num_layers
    if t.fp8_recipe == "none":
        return None
    numbers = fp8_layer_numbers(cfg)
    where = "every transformer layer"
    if len(numbers) < layers:
        kept = (f"layers {', '.join(map(str, sorted(set(range(layers)) - set(numbers))))} in {t.precision}: "
                "train.fp8_first_last_layers_bf16")
        where = (f"transformer layers {numbers.start}-{numbers.stop - 1} of 0-{layers - 1} ({kept})" if numbers
                 else f"no transformer layer ({kept})")
    mtp = " and multi-token prediction's layers" if cfg.model.mtp_num_layers else ""
    head = ("the LM head in FP8 too (train.fp8_output_head); embeddings and the routers" if t.fp8_output_head
            else "embeddings, the LM head and the routers")
    gathers = (f"; weights all-gathered in {t.param_dtype}" if cfg.parallel.zero >= 1 else "") if \
        not t.fp8_param_gather else (f"; their weights all-gathered in FP8 (train.fp8_param_gather), the rest in "
                                     f"{t.param_dtype}")
    return (f"FP8 on: train.fp8_recipe={t.fp8_recipe} (forward, input and weight gradients) in the linears and "
            f"experts of {where}{mtp}; {head} in {t.precision}{gathers}")


def memory_line(cfg: Config, world_size: int, device_name: str, device_bytes: int) -> str:
    """The planner's estimate for the stage that needs most against the device's memory (on a GPU)."""
    stages = memory_per_stage(cfg, world_size, "cuda")
    worst = max(stages, key=lambda s: s.total)
    share = worst.total / device_bytes
    verdict = "" if share <= 1 else "; it does not fit: see `python tools/plan.py --config ...` for layouts that do"
    where = f" (pipeline stage {worst.pp_rank})" if cfg.parallel.pp > 1 else ""
    return (f"memory (planner): {worst.total / 2**30:.1f} GiB per GPU{where} of {device_bytes / 2**30:.1f} GiB "
            f"on {device_name} ({share:.0%}){verdict}")


def gpu_memory_line(cfg: Config, world_size: int, device: torch.device) -> str | None:
    """memory_line for this rank's GPU; None on a CPU. A summary line never stops a run: a planner that cannot
    take the config says so in the line."""
    gpu = device_memory(device)
    if gpu is None:
        return None
    try:
        return memory_line(cfg, world_size, *gpu)
    except Exception as error:  # noqa: BLE001
        return f"memory (planner): n/a ({type(error).__name__}: {error})"


@dataclass
class Clock:
    """Where the run is in time: started when the training loop starts, at `start_step` of `total` steps."""

    start_step: int
    total: int
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def figures(self, step: int, steps: int, seconds: float) -> dict[str, float]:
        """A log step's time figures: seconds per step over the last `steps` steps (which took `seconds`), time
        since the loop started, and the time left at that pace."""
        per_step = seconds / max(steps, 1)
        return {"s_per_step": per_step, "elapsed_s": self.elapsed, "eta_s": per_step * (self.total - step)}


def end_summary(cfg: Config, clock: Clock, step: int, tokens_per_step: int, train_loss: float | None,
                val_loss: float | None, checkpoint: str | None, wandb_dir: str | None) -> str:
    """The lines that close a run's log: what was trained, how long it took, the final losses and where every
    output went."""
    steps = step - clock.start_step
    seconds = clock.elapsed
    tokens = steps * tokens_per_step
    rate = f", {seconds / steps:.3g} s/step, {tokens / seconds:,.0f} tokens/s" if steps and seconds > 0 else ""
    resumed = f" (resumed at step {clock.start_step})" if clock.start_step else ""
    lines = [f"run summary: {steps} steps to step {step}/{clock.total}{resumed}, {tokens:,} tokens "
             f"in {format_duration(seconds)}{rate}"]
    losses = [f"train loss {train_loss:.4f}" if train_loss is not None else "",
              f"validation loss {val_loss:.4f}" if val_loss is not None else ""]
    if any(losses):
        lines.append(f"  final {', '.join(loss for loss in losses if loss)}")
    outputs = [("checkpoint", checkpoint and f"{checkpoint} (the same command resumes from it)"),
               ("metrics", cfg.logging.metrics_file),
               ("W&B", wandb_dir and f"{wandb_dir}" + (" (upload: wandb sync DIR)"
                                                        if cfg.logging.wandb_mode == "offline" else ""))]
    lines += [f"  {name:<10} {where}" for name, where in outputs if where]
    return "\n".join(lines)
