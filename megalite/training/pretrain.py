"""The training run: build everything from the config, resume, loop, log, evaluate, save."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint.full_state import FullState
from megalite.checkpoint.local import TrainingState, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from megalite.config import Config, validate
from megalite.config_cli import dump_yaml
from megalite.data.build import build_training_data, tokenizer_from_config
from megalite.data.loader import micro_batches
from megalite.parallel.topology import Topology, peak_memory, synchronize
from megalite.training.build import build_rank_model
from megalite.training.evaluate import evaluate
from megalite.training.flops import peak_tflops, training_flops_per_token
from megalite.training.loss_scaler import LossScaler
from megalite.training.lr_schedule import learning_rate
from megalite.training.metrics import MetricsWriter
from megalite.training.optimizer import build_optimizer, set_learning_rate
from megalite.parallel.schedules import Trace
from megalite.training.step import StepResult, train_step
from megalite.training.trace import write_chrome_trace

_CONSOLE = {"loss": "loss", "lr": "lr", "grad_norm": "grad norm", "loss_scale": "loss scale", "skipped_steps": "skipped",
            "tokens_per_sec": "tokens/s", "tflops_per_device": "TFLOP/s/device", "mfu": "MFU", "peak_memory_gib": "peak mem GiB"}


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)
    final_step: int = 0
    val_loss: float | None = None
    checkpoint: Path | None = None
    wandb_dir: str | None = None
    wandb_run_id: str | None = None


class Run:
    def __init__(self, cfg: Config, topology: Topology) -> None:
        self.cfg, self.topology = cfg, topology
        self.gbs = cfg.batch_size(topology.world_size)
        tokenizer = tokenizer_from_config(cfg.data, cfg.model.vocab_size)
        if tokenizer is not None:
            cfg.model.vocab_size = tokenizer.vocab_size
        valid_samples = cfg.train.eval_iters * self.gbs if cfg.train.eval_interval else 0
        self.data = build_training_data(cfg, topology.rank, tokenizer, cfg.train.train_iters * self.gbs, valid_samples)
        parts = build_rank_model(cfg, topology)
        self.model, self.tp, self.reducer, self.pipeline = parts.model, parts.tp, parts.reducer, parts.pipeline
        if cfg.logging.pipeline_trace:
            self.pipeline.trace = Trace()
        self.optimizer = build_optimizer(self.reducer.param_groups(cfg.optim.weight_decay), cfg.optim, topology.device)
        self.scaler = LossScaler.for_precision(cfg.train.precision, cfg.optim)
        self.full_state = FullState(self.model, self.optimizer, self.tp, topology, self.reducer.main)
        self.state = TrainingState(step=0, consumed_samples=0, loss_scaler=self.scaler.state_dict())
        self.resumed_from = self._resume()
        self.writer = MetricsWriter(cfg, topology.is_logging_rank, self.state.step, self.state.wandb_run_id)
        self.state.wandb_run_id = self.writer.wandb_run_id
        self.flops_per_token = training_flops_per_token(cfg.model)
        self.peak = peak_tflops(topology.device, cfg.train.precision, cfg.logging.peak_tflops)
        self.skipped_steps, self.saved_step = 0, -1
        self.result = RunResult()

    def _resume(self) -> Path | None:
        load = self.cfg.checkpoint.load
        if not load:
            return None
        if not Path(load).exists() and load != self.cfg.checkpoint.save:
            raise FileNotFoundError(f"checkpoint.load={load} does not exist; fix the path or drop --checkpoint.load to start from scratch")
        path = latest_checkpoint(load) if Path(load).exists() else None
        if path is not None:
            self.state, rng = load_checkpoint(path, self.full_state, self.topology)
            if rng is not None:
                set_rng_state(rng, self.topology.device, self.tp.rng)
            self.scaler.load_state_dict(self.state.loss_scaler)
        return path

    def train(self) -> RunResult:
        cfg, start = self.cfg, self.state.step
        self._announce()
        t = self.topology
        stream = micro_batches(self.data.train, self.data.maker, self.state.consumed_samples, cfg.train.train_iters * self.gbs,
                               cfg.train.micro_batch_size, t.dp, t.dp_rank, cfg.data.num_workers, t.device)
        per_step = cfg.num_microbatches(t.world_size)
        interval_start, interval_steps = time.perf_counter(), 0
        while self.state.step < cfg.train.train_iters:
            step = self.state.step + 1
            set_learning_rate(self.optimizer, learning_rate(step, cfg.optim, cfg.train.train_iters))
            batches = [next(stream) for _ in range(per_step)]
            result = train_step(self.model, self.optimizer, self.scaler, self.reducer, batches, t, cfg.train.precision, cfg.optim.clip_grad, self.pipeline)
            self.state.step, self.state.consumed_samples = step, self.state.consumed_samples + self.gbs
            self.state.loss_scaler = self.scaler.state_dict()
            self.skipped_steps += result.skipped
            self.result.losses[step] = result.loss
            self.writer.advance()
            if self.pipeline.trace is not None and step - start == cfg.logging.pipeline_trace_steps:
                self._write_trace(step - start)
            interval_steps += 1
            if step % cfg.logging.log_interval == 0 or step == cfg.train.train_iters:
                synchronize(self.topology.device)
                self._log_step(step, result, interval_steps, time.perf_counter() - interval_start)
                interval_start, interval_steps = time.perf_counter(), 0
            if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
                self._evaluate()
            exiting = cfg.train.exit_interval is not None and step % cfg.train.exit_interval == 0
            if cfg.checkpoint.save and (exiting or (cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0)):
                self._save()
            if exiting:
                self.writer.print(f"train.exit_interval={cfg.train.exit_interval} reached at step {step}; exiting cleanly")
                break
        return self._finish(start)

    def _finish(self, start_step: int) -> RunResult:
        cfg, step = self.cfg, self.state.step
        self.reducer.wait_params()
        if step >= cfg.train.train_iters and cfg.train.eval_interval and step % cfg.train.eval_interval:
            self._evaluate()
        if self.pipeline.trace is not None and step > start_step:
            self._write_trace(step - start_step)
        if cfg.checkpoint.save and step > start_step and self.saved_step != step:
            self._save()
        self.result.final_step = step
        if self.writer.wandb_run:
            self.result.wandb_dir, self.result.wandb_run_id = self.writer.wandb_run.dir, self.writer.wandb_run.id
        self.writer.close()
        return self.result

    def _announce(self) -> None:
        t, cfg = self.topology, self.cfg
        params = sum(shape.numel() for shape in self.full_state.model_tensors_shapes().values())
        self.writer.print(f"megalite config:\n{dump_yaml(cfg)}")
        self.writer.print(
            f"world {t.world_size} (tp {t.tp}, pp {t.pp}, dp {t.dp}) on {t.device}; {params / 1e6:.2f}M parameters; "
            f"global batch {self.gbs} = {cfg.num_microbatches(t.world_size)} micro batches x {cfg.train.micro_batch_size} x dp {t.dp}"
        )
        if self.resumed_from:
            self.writer.print(f"resumed from {self.resumed_from} at step {self.state.step} ({self.state.consumed_samples} samples consumed)")
        elif cfg.checkpoint.load:
            self.writer.print(f"no checkpoint in {cfg.checkpoint.load} yet; starting from scratch")

    def _log_step(self, step: int, result: StepResult, steps: int, seconds: float) -> None:
        tokens_per_sec = steps * self.gbs * self.cfg.model.seq_length / seconds
        tflops = tokens_per_sec * self.flops_per_token / self.topology.world_size / 1e12
        memory, what = peak_memory(self.topology.device)
        record = {
            "step": step, "loss": result.loss, "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": result.grad_norm,
            "loss_scale": self.scaler.scale, "skipped_steps": self.skipped_steps, "consumed_samples": self.state.consumed_samples,
            "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": tokens_per_sec / self.topology.world_size,
            "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
            "peak_memory_gib": memory, "peak_memory_kind": what,
        }
        self.writer.log(record, _CONSOLE)

    def _write_trace(self, steps: int) -> None:
        write_chrome_trace(self.cfg.logging.pipeline_trace, self.pipeline.trace, self.topology, steps)
        self.pipeline.trace = None
        self.writer.print(f"pipeline trace of {steps} steps written to {self.cfg.logging.pipeline_trace}")

    def _evaluate(self) -> None:
        if self.data.valid is None:
            return
        loss, ppl = evaluate(self.model, self.data, self.cfg, self.topology, self.pipeline)
        self.result.val_loss = loss
        self.writer.log({"step": self.state.step, "val_loss": loss, "val_ppl": ppl}, {"val_loss": "validation loss", "val_ppl": "ppl"})

    def _save(self) -> None:
        self.reducer.wait_params()
        rng = rng_state(self.topology.device, self.tp.rng)
        path = save_checkpoint(self.cfg.checkpoint.save, self.state, self.full_state, dump_yaml(self.cfg), self.topology, rng)
        self.saved_step = self.state.step
        self.result.checkpoint = path
        self.writer.print(f"saved checkpoint {self.result.checkpoint}")


def pretrain(cfg: Config) -> RunResult:
    """Train as configured; joins the torchrun job if there is one, else runs as one process.

    Works on a copy of `cfg`: the tokenizer fills in model.vocab_size for this run only.
    """
    cfg = copy.deepcopy(cfg)
    validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    created = not dist.is_initialized()
    topology = Topology.from_environment(cfg.train.device, cfg.parallel.timeout_minutes, cfg.parallel.tp, cfg.parallel.pp)
    try:
        torch.manual_seed(cfg.train.seed)
        run = Run(cfg, topology)
        try:
            result = run.train()
        except BaseException:
            run.writer.close(exit_code=1)
            raise
        dist.barrier()
        return result
    finally:
        if created:
            dist.destroy_process_group()
