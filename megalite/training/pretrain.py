"""The training run: build everything from the config, resume, loop, log, evaluate, save."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint.compatibility import model_changes, saved_model
from megalite.checkpoint.local import Checkpointer, TrainingState, rng_state, set_rng_state
from megalite.checkpoint.resume import resume, where_to_resume
from megalite.config import Config
from megalite.config_cli import dump_yaml
from megalite.config_resolved import resolved_yaml
from megalite.config_validation import validate
from megalite.data.build import build_training_data
from megalite.data.loader import MicroBatches, micro_batches
from megalite.errors import UserError
from megalite.parallel.pipeline.executor import Trace
from megalite.parallel.timeouts import collective_timeout_message
from megalite.parallel.topology import Topology, peak_memory, release_process_groups, synchronize
from megalite.training.build import build_trainer, is_logging_rank
from megalite.training.evaluate import evaluate
from megalite.training.flops import peak_tflops, throughput
from megalite.training.lr_schedule import learning_rate
from megalite.training.metrics import MetricsWriter, wandb_enabled
from megalite.training.mtp_metrics import MTPMetrics
from megalite.training.profiling import Profiler
from megalite.training.report_once import ReportOnce
from megalite.training.routing_metrics import RoutingMetrics
from megalite.training.run_summary import Clock, end_summary, fp8_line, gpu_memory_line, parameters_line
from megalite.training.step import StepFigures, StepResult, read_steps, train_step
from megalite.training.stopping import StopSignals, StopVote, write_report
from megalite.training.trace import write_chrome_trace
from megalite.training.vocabulary import set_vocabulary
from megalite.training.wandb_logger import new_run_id

_CONSOLE = {"loss": "loss", "lr": "lr", "grad_norm": "grad norm", "loss_scale": "loss scale",
            "skipped_steps": "skipped", "tokens_per_sec": "tokens/s", "tflops_per_device": "model TFLOP/s/device",
            "mfu": "MFU", "hardware_tflops_per_device": "hardware TFLOP/s/device", "hfu": "HFU",
            "peak_memory_gib": "peak mem GiB", "s_per_step": "s/step", "elapsed_s": "elapsed", "eta_s": "ETA"}
_HARDWARE = ("hardware_tflops_per_device", "hfu")  # equal to the model figures, so not printed, without recompute


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)
    final_step: int = 0
    val_loss: float | None = None
    checkpoint: Path | None = None
    wandb_dir: str | None = None
    wandb_run_id: str | None = None
    stopped_by: signal.Signals | None = None  # a signal stopped the run before train.train_iters (saved if
    # `checkpoint` is set)


class Run:
    def __init__(self, cfg: Config, topology: Topology, signals: StopSignals) -> None:
        self.cfg, self.topology, self.signals = cfg, topology, signals
        # first: a memory snapshot then sees every allocation
        self.profiler = Profiler(cfg.logging, topology.rank, topology.device)
        self.gbs = cfg.batch_size(topology.world_size)
        tokenizer = set_vocabulary(cfg)[0]
        valid_samples = cfg.train.eval_iters * self.gbs if cfg.train.eval_interval else 0
        self.data = build_training_data(cfg, topology.rank, tokenizer, cfg.train.train_iters * self.gbs, valid_samples)
        self.trainer = build_trainer(cfg, topology)
        self.optimizer, self.pipeline = self.trainer.optimizer, self.trainer.pipeline
        self.trace = Trace(topology.device) if cfg.logging.pipeline_trace else None
        if self.trace is not None:
            self.pipeline.observers.append(self.trace)
        self.sharded = self.trainer.sharded_state()
        c = cfg.checkpoint
        self.checkpointer = Checkpointer(c.save, topology, c.async_save, c.keep_last) if c.save else None
        self.state = TrainingState(step=0, consumed_samples=0, loss_scaler=self.trainer.scaler.state_dict())
        self.started = time.monotonic()
        self.notes: list[str] = []
        self.resumed_from, self.damaged = self._resume()
        if wandb_enabled(cfg) and not self.state.wandb_run_id:  # chosen now, saved in every checkpoint
            chosen = [new_run_id()]
            dist.broadcast_object_list(chosen, src=0)
            self.state.wandb_run_id = chosen[0]
        self.writer = MetricsWriter(cfg, is_logging_rank(cfg, topology), self.state.step, self.state.wandb_run_id)
        self.console = {key: label for key, label in _CONSOLE.items()
                        if cfg.train.recompute != "none" or key not in _HARDWARE}
        self.routing = RoutingMetrics(cfg.model, topology) if cfg.model.num_experts else None
        self.mtp = MTPMetrics(cfg.model.mtp_num_layers, topology) if cfg.model.mtp_num_layers else None
        self.peak = peak_tflops(topology.device, cfg.train.precision, cfg.logging.peak_tflops)
        self.saved_step, self.diverged_in_a_row = -1, 0
        self.unread: list[tuple[int, StepResult]] = []  # steps whose figures are still on the device
        self.stream: MicroBatches | None = None
        self.result = RunResult()

    def _resume(self) -> tuple[Path | None, list[str]]:
        """Resume from checkpoint.load (default: checkpoint.save, so a restarted job continues); every rank
        reads only what it holds (checkpoint/resume.py)."""
        c = self.cfg.checkpoint
        load, note = where_to_resume(c)
        if not load:
            return None, []
        if note:
            self.notes.append(note)
        resumed = resume(load, c.fallback, self.sharded, self.topology, c.load_optimizer, c.load_timeout_minutes,
                         self.cfg.model)
        if resumed is None:
            return None, []
        changes = model_changes(saved_model(resumed.path), self.cfg.model)[1]
        if changes:
            self.notes.append(f"model changed since {resumed.path} was saved: {', '.join(map(str, changes))}")
        self.optimizer.gather_params()  # the distributed optimizer's ranks loaded only their own slices
        self.state = resumed.state
        if resumed.rng is not None:
            set_rng_state(resumed.rng, self.topology.device, self.trainer.ctx.rng)
        self.trainer.scaler.load_state_dict(self.state.loss_scaler)
        if not resumed.optimizer_loaded:
            why = "checkpoint.load_optimizer=false" if not c.load_optimizer else "the checkpoint holds weights only"
            self.notes.append(f"optimizer state not loaded ({why}): Adam's moments and step start from zero")
        return resumed.path, resumed.skipped

    def train(self) -> RunResult:
        cfg, start = self.cfg, self.state.step
        self._announce()
        t = self.topology
        self.stream = stream = micro_batches(self.data.train, self.data.maker, self.state.consumed_samples,
                                             cfg.train.train_iters * self.gbs, cfg.train.micro_batch_size, t.dp,
                                             t.dp_rank, cfg.data.num_workers, t.device)
        per_step = cfg.num_microbatches(t.world_size)
        self.clock = Clock(start, cfg.train.train_iters)
        self.interval = (time.perf_counter(), 0)
        vote = StopVote(t, self.signals, cfg.train.exit_duration_mins, self.started)
        while self.state.step < cfg.train.train_iters:
            step = self.state.step + 1
            self.optimizer.set_lr(learning_rate(step, cfg.optim, cfg.train.train_iters))
            batches = [next(stream) for _ in range(per_step)]
            self.profiler.step_started(step)
            result = train_step(self.trainer, batches)
            if self.routing is not None:
                self.routing.add_step(self.trainer.model.aux_losses)
            if self.mtp is not None:
                self.mtp.add_step(self.trainer.model.aux_losses, result.tokens_on_device)
            self.profiler.step_finished(step)
            self.state.step, self.state.consumed_samples = step, self.state.consumed_samples + self.gbs
            self.state.loss_scaler = self.trainer.scaler.state_dict()
            self._after_step(step, start, result)
            reason = self._stop_reason(step, vote)
            wanted = cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0
            if self.checkpointer and (reason or wanted):
                self._save()
            if reason:
                if not self.result.stopped_by:
                    self.writer.print(f"{reason} at step {step}; exiting cleanly")
                break
        return self._finish(start)

    def _after_step(self, step: int, start: int, result: StepResult) -> None:
        cfg = self.cfg
        self.unread.append((step, result))
        self.writer.advance()
        if self.trace is not None and step - start == cfg.logging.pipeline_trace_steps:
            self._write_trace(step - start)
        began, steps = self.interval
        self.interval = (began, steps + 1)
        if step % cfg.logging.log_interval == 0 or step == cfg.train.train_iters:
            synchronize(self.topology.device)
            figures = self._read_steps()
            self._log_step(step, figures, steps + 1, time.perf_counter() - began)
            self._publish_finished_save()
            self.interval = (time.perf_counter(), 0)
        if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            self._evaluate()

    def _publish_finished_save(self) -> None:
        """Publish an asynchronous save every rank has finished writing. Asking is a collective read on the
        host, so it happens at log steps only, where the host waits for the device anyway; nothing is lost
        in between: the next save and the end of the run wait for the pending one and publish it."""
        if self.checkpointer:
            done = self.checkpointer.poll()
            if done:
                self.writer.print(f"checkpoint {done} complete")

    def _read_steps(self) -> StepFigures | None:
        """Read the steps since the last read on the host (one wait for the device) and account for them:
        losses, skipped steps, diverged steps in a row (too many stop the run). Returns the last step's."""
        unread, self.unread = self.unread, []
        figures = read_steps([result for _, result in unread])
        for (step, _), read in zip(unread, figures):
            self.result.losses[step] = read.loss
            self.state.skipped_steps += read.skipped
            if read.diverged:
                self._skip_diverged(step, read)
            else:
                self.diverged_in_a_row = 0
        return figures[-1] if figures else None

    def _skip_diverged(self, step: int, read: StepFigures) -> None:
        """A NaN/Inf gradient norm: the update was skipped; too many in a row stop the run (noticed at the
        log step that reads them)."""
        self.diverged_in_a_row += 1
        limit = self.cfg.train.max_skipped_steps
        self.writer.print(f"step {step}: loss {read.loss} / gradient norm {read.grad_norm} is not finite; "
                          f"update skipped ({self.diverged_in_a_row} in a row, train.max_skipped_steps={limit})")
        if self.diverged_in_a_row >= limit:
            where = ""
            if self.checkpointer:
                self._save()
                where = f"; the last good weights are in {self.result.checkpoint}"
            raise FloatingPointError(f"{limit} consecutive steps had a NaN/Inf loss or gradient norm "
                                     f"(last: step {step}): training diverged{where}. Lower optim.lr, "
                                     "raise optim.warmup_iters or check the data, then resume")

    def _stop_reason(self, step: int, vote: StopVote) -> str | None:
        """Why every rank should stop now: they agree at every step (one rank's signal or clock stops all;
        stopping.py), and on train.exit_interval."""
        train = self.cfg.train
        stopped_by, late = vote.after_step()
        if stopped_by:
            self.result.stopped_by = stopped_by
            return f"{stopped_by.name} received"
        if late:
            return f"train.exit_duration_mins={train.exit_duration_mins} passed"
        if train.exit_interval is not None and step % train.exit_interval == 0:
            return f"train.exit_interval={train.exit_interval} reached"
        return None

    def _finish(self, start_step: int) -> RunResult:
        cfg, step = self.cfg, self.state.step
        self._read_steps()
        self.optimizer.wait_params()
        if step >= cfg.train.train_iters and cfg.train.eval_interval and step % cfg.train.eval_interval:
            self._evaluate()
        if self.trace is not None and step > start_step:
            self._write_trace(step - start_step)
        if self.checkpointer and step > start_step and self.saved_step != step:
            self._save()
        if self.checkpointer:
            self.checkpointer.wait()
        self.result.final_step = step
        if self.result.stopped_by:
            self._say_where_it_stopped()
        return self.result

    def _say_where_it_stopped(self) -> None:
        name, step, saved = self.result.stopped_by.name, self.state.step, self.result.checkpoint
        if self.checkpointer:
            self.writer.print(f"{name} received: stopped after step {step} and saved {saved}; "
                              "run the same command to resume from it")
        else:
            self.writer.print(f"{name} received: stopped after step {step} without saving "
                              "(set checkpoint.save to resume after a preemption)")

    def close(self, failed: bool = False) -> None:
        """Release what the run started, before the process group goes: data workers, the trainer's
        collectives in flight, a checkpoint write still running (`failed`: joined, not published), the
        profiler and the metrics writer. On a failure the first error is what the user sees, so the
        trainer's waits (which may fail too once a peer is gone) do not replace it."""
        if self.stream is not None:
            self.stream.close()
        if self.checkpointer and failed:
            self.checkpointer.abandon()
        if failed:
            with contextlib.suppress(Exception):
                self.trainer.close()
        else:
            self.trainer.close()
        self.profiler.close()
        self.writer.close(exit_code=1 if failed else 0)
        self.result.wandb_dir, self.result.wandb_run_id = self.writer.wandb_dir, self.state.wandb_run_id
        if not failed:
            self._summarize()

    def _summarize(self) -> None:
        """The end-of-run summary, the last lines of the log."""
        r, tokens_per_step = self.result, self.gbs * self.cfg.model.seq_length
        wandb_run = str(Path(r.wandb_dir).parent) if r.wandb_dir else None
        self.writer.print(end_summary(self.cfg, self.clock, r.final_step, tokens_per_step, r.losses.get(r.final_step),
                                      r.val_loss, r.checkpoint and str(r.checkpoint), wandb_run))

    def _announce(self) -> None:
        t, cfg = self.topology, self.cfg
        self.writer.print(f"megalite config (resolved: derived defaults filled in):\n{resolved_yaml(cfg)}")
        self.writer.print(
            f"world {t.world_size} (tp {t.tp}, {f'cp {t.cp}, ' if t.cp > 1 else ''}pp {t.pp}, dp {t.dp}) "
            f"on {t.device}; global batch {self.gbs} = {cfg.num_microbatches(t.world_size)} micro batches x "
            f"{cfg.train.micro_batch_size} x dp {t.dp}"
        )
        self.writer.print(parameters_line(cfg))
        if fp8 := fp8_line(cfg):
            self.writer.print(fp8)
        memory = gpu_memory_line(cfg, t.world_size, t.device)
        if memory:
            self.writer.print(memory)
        for problem in self.damaged:
            self.writer.print(f"skipped a damaged checkpoint: {problem}")
        for note in self.notes:
            self.writer.print(note)
        if self.resumed_from:
            self.writer.print(f"resumed from {self.resumed_from} at step {self.state.step} "
                              f"({self.state.consumed_samples} samples consumed)")
        elif cfg.checkpoint.load or cfg.checkpoint.save:
            self.writer.print(f"no checkpoint in {cfg.checkpoint.load or cfg.checkpoint.save} yet; "
                              "starting from scratch")

    def _log_step(self, step: int, result: StepFigures, steps: int, seconds: float) -> None:
        tokens_per_sec = steps * self.gbs * self.cfg.model.seq_length / seconds
        memory, what = peak_memory(self.topology.device)
        record = {
            "step": step, "loss": result.loss, "lr": self.optimizer.lr, "grad_norm": result.grad_norm,
            "loss_scale": self.trainer.scaler.scale, "skipped_steps": self.state.skipped_steps,
            "consumed_samples": self.state.consumed_samples,
            "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": tokens_per_sec / self.topology.world_size,
            **throughput(tokens_per_sec / self.topology.world_size, self.cfg.model, self.cfg.train.recompute,
                         self.peak),
            "peak_memory_gib": memory, "peak_memory_kind": what, **self.clock.figures(step, steps, seconds),
        }
        if self.routing is not None:
            record |= self.routing.read(self.cfg.num_microbatches(self.topology.world_size))
        if self.mtp is not None:
            record |= self.mtp.read()
        if self.trainer.qk_clip is not None:
            record |= self.trainer.qk_clip.read()
        self.writer.log(record, self.console)

    def _write_trace(self, steps: int) -> None:
        write_chrome_trace(self.cfg.logging.pipeline_trace, self.trace, self.topology, steps)
        self.pipeline.observers.remove(self.trace)
        self.trace = None
        self.writer.print(f"pipeline trace of {steps} steps written to {self.cfg.logging.pipeline_trace}")

    def _evaluate(self) -> None:
        if self.data.valid is None:
            return
        loss, ppl = evaluate(self.trainer, self.data)
        self.result.val_loss = loss
        self.writer.log({"step": self.state.step, "val_loss": loss, "val_ppl": ppl},
                        {"val_loss": "validation loss", "val_ppl": "ppl"})

    def _save(self) -> None:
        self._read_steps()  # the saved state counts the skipped steps
        self.optimizer.wait_params()
        rng = rng_state(self.topology.device, self.trainer.ctx.rng)
        path = self.checkpointer.save(self.state, self.sharded, dump_yaml(self.cfg), rng)
        self.saved_step = self.state.step
        self.result.checkpoint = path
        self.writer.print(f"{'writing' if self.cfg.checkpoint.async_save else 'saved'} checkpoint {path}")


def allow_tf32(allowed: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN convolutions on CUDA (torch's default turns it off for matmuls);
    no effect on CPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed


def pretrain(cfg: Config) -> RunResult:
    """Train as configured; joins the torchrun job if there is one, else runs as one process.

    Works on a copy of `cfg`: model.vocab_size is filled in (training/vocabulary.py) for this run only.
    """
    cfg = copy.deepcopy(cfg)
    validate(cfg, int(os.environ.get("WORLD_SIZE", 1)), data_files=True)
    created = not dist.is_initialized()
    topology = Topology.from_environment(cfg.train.device, cfg.parallel, experts=cfg.model.num_experts > 0)
    signals = StopSignals().install()  # before the data workers and W&B start: a signal then only asks to stop
    try:
        report = ReportOnce()
        torch.manual_seed(cfg.train.seed)
        allow_tf32(cfg.train.allow_tf32)
        run = Run(cfg, topology, signals)
        try:
            result = run.train()
        except BaseException as error:
            run.close(failed=True)
            message = collective_timeout_message(error, topology.rank, cfg.parallel.timeout_minutes,
                                                 topology.named_groups())
            if message:
                raise RuntimeError(message) from error
            raise
        run.close()
        dist.barrier()
        if result.stopped_by and result.checkpoint:
            write_report(result.stopped_by, result.final_step, result.checkpoint)
        return result
    except UserError as error:
        report.claim(error)
        raise
    finally:
        signals.restore()
        if created:
            run = topology = None  # nothing of the run may hold a group once they are destroyed
            release_process_groups()

