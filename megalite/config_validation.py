"""Validation of a run's config: every problem reported at once, each naming the field and the fix.

Checked once, before the process group forms (pretrain) or a job is planned (tools/plan.py), so
a bad job fails in its first second instead of after queueing on a cluster. W&B credentials
and the profiling fields are checked here too: both would otherwise fail only once training runs.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from megalite.config import Config, ConfigError, LoggingConfig
from megalite.config_attention import attention_errors, rope_scaling_errors, window_and_sink_errors
from megalite.config_fp8 import fp8_errors
from megalite.config_mla import group_score_errors, latent_attention_errors
from megalite.config_mtp import mtp_errors
from megalite.data.blending import parse_blend
from megalite.data.indexed_dataset import data_file_path, index_file_path
from megalite.data.megatron_blending import MAX_DATASETS
from megalite.parallel.pipeline.registry import SCHEDULES, training_schedules
from megalite.parallel.pipeline.stage import chunk_layer_counts


def validate(cfg: Config, world_size: int, data_files: bool = False) -> None:
    """Raise ConfigError listing every problem at once, each with its fix. `data_files`: also check that the
    corpus files named in data.paths / train_paths / valid_paths exist (pretrain does; planning a run, on a
    machine that does not hold them, does not)."""
    errors = [e for check in _CHECKS for e in check(cfg, world_size)]
    ConfigError.raise_if(errors + (_check_data_files(cfg) if data_files else []))


def _check_model(cfg: Config, world_size: int) -> list[str]:
    m, errors = cfg.model, []
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "make_vocab_size_divisible_by"):
        if getattr(m, name) is not None and getattr(m, name) < 1:
            errors.append(f"model.{name}={getattr(m, name)} must be >= 1")
    if errors:
        return errors
    errors += attention_errors(m) + window_and_sink_errors(m) + rope_scaling_errors(m)
    if m.positions < m.seq_length:
        errors.append(f"model.max_position_embeddings={m.positions} < model.seq_length={m.seq_length}; "
                      "raise it or leave it unset")
    if m.make_vocab_size_divisible_by % cfg.parallel.tp:
        errors.append(f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} must be divisible by "
                      f"parallel.tp={cfg.parallel.tp} so the padded vocabulary does not depend on the layout")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            errors.append(f"model.{name}={getattr(m, name)} must be in [0, 1)")
    return errors


def _check_moe(cfg: Config, world_size: int) -> list[str]:
    m, p, errors = cfg.model, cfg.parallel, []
    if p.ep < 1 or p.etp < 1:
        return [f"parallel.ep={p.ep} and parallel.etp={p.etp} must be >= 1"]
    if m.num_experts == 0:
        split = [f"parallel.{name}={getattr(p, name)}" for name in ("ep", "etp") if getattr(p, name) > 1]
        return [f"{' and '.join(split)} need experts; set model.num_experts"] if split else []
    if m.num_experts < 0:
        return [f"model.num_experts={m.num_experts} must be >= 0 (0: dense MLPs)"]
    if not 1 <= m.moe_topk <= m.num_experts:
        errors.append(f"model.moe_topk={m.moe_topk} must be between 1 and model.num_experts={m.num_experts}")
    if m.num_experts % p.ep:
        errors.append(f"model.num_experts={m.num_experts} is not divisible by parallel.ep={p.ep}: every "
                      "expert-parallel rank holds the same number of experts")
    if world_size % (p.etp * p.ep * p.pp):
        errors.append(f"world size {world_size} is not divisible by parallel.etp*parallel.ep*parallel.pp="
                      f"{p.etp * p.ep * p.pp}: the expert grid is carved out of each pipeline stage's ranks; "
                      f"{_launch_hint(p.etp * p.ep * p.pp)}")
    if m.expert_ffn_size % p.etp:
        errors.append(f"the experts' width (model.moe_ffn_hidden_size) {m.expert_ffn_size} is not divisible by "
                      f"parallel.etp={p.etp}; pick an etp that divides it")
    if p.tp > 1 and not p.sequence_parallel:
        errors.append("mixture-of-experts layers with parallel.tp > 1 need parallel.sequence_parallel=true (each "
                      "tensor-parallel rank routes its own slice of the tokens)")
    groups, chosen = m.moe_router_groups, m.moe_router_group_topk or m.moe_router_groups
    if groups < 1 or m.num_experts % groups:
        errors.append(f"model.moe_router_groups={groups} must divide model.num_experts={m.num_experts}")
    elif not 1 <= chosen <= groups or m.moe_topk > chosen * (m.num_experts // groups) or chosen > m.moe_topk:
        errors.append(f"model.moe_router_group_topk={chosen} must be between 1 and min(model.moe_topk, "
                      f"model.moe_router_groups) and leave at least moe_topk={m.moe_topk} experts to choose from")
    for name in ("moe_aux_loss_coeff", "moe_seq_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_size",
                 "moe_first_dense_layers", "moe_bias_update_rate"):
        if getattr(m, name) < 0:
            errors.append(f"model.{name}={getattr(m, name)} must be >= 0")
    if m.moe_capacity_factor is not None and m.moe_capacity_factor <= 0:
        errors.append(f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (or unset: dropless)")
    if m.moe_capacity_factor is not None and p.moe_dispatcher != "alltoall":
        errors.append("model.moe_capacity_factor needs parallel.moe_dispatcher=alltoall (each rank drops from its "
                      "own tokens before they travel)")
    if m.moe_pad_to_capacity and m.moe_capacity_factor is None:
        errors.append("model.moe_pad_to_capacity=true needs a model.moe_capacity_factor")
    if m.moe_shared_expert_size % p.tp:
        errors.append(f"model.moe_shared_expert_size={m.moe_shared_expert_size} is not divisible by parallel.tp="
                      f"{p.tp}; the shared expert is a tensor-parallel MLP")
    if m.moe_layer_freq < 1:
        errors.append(f"model.moe_layer_freq={m.moe_layer_freq} must be >= 1")
    elif not m.moe_layers:
        errors.append(f"model.num_experts={m.num_experts} but no layer is a mixture of experts: "
                      f"model.moe_first_dense_layers={m.moe_first_dense_layers} covers all {m.num_layers} layers")
    return errors


def _check_parallel(cfg: Config, world_size: int) -> list[str]:
    p, errors = cfg.parallel, []
    for name in ("tp", "cp", "pp", "vp"):
        if getattr(p, name) < 1:
            errors.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if errors:
        return errors
    if world_size % (p.tp * p.cp * p.pp):
        axes = ("tp", "cp", "pp") if p.cp > 1 else ("tp", "pp")
        product = "*".join(axes)
        errors.append(f"world size {world_size} is not divisible by {'*'.join('parallel.' + a for a in axes)}="
                      f"{p.tp * p.cp * p.pp}; launch a multiple of {product} processes (dp = world/({product})), "
                      f"{_launch_hint(p.tp * p.cp * p.pp)}")
    errors += _check_context_parallel(cfg)
    errors += _check_pipeline(cfg, world_size)
    m = cfg.model
    for value, what in ((m.num_attention_heads, "model.num_attention_heads"),
                        (m.kv_heads, "model.num_query_groups (KV heads)"),
                        (m.ffn_size, "the MLP width (model.ffn_hidden_size)")):
        if value % p.tp:
            errors.append(f"{what}={value} is not divisible by parallel.tp={p.tp}: every tensor-parallel rank holds "
                          "whole heads/slices; pick a tp that divides it")
    if p.sequence_parallel_active and m.seq_length % p.tp:
        errors.append(f"model.seq_length={m.seq_length} is not divisible by parallel.tp={p.tp}, "
                      "which sequence parallelism shards it over")
    if p.zero_stage is not None and p.zero_stage not in (0, 1, 2, 3):
        errors.append(f"parallel.zero_stage={p.zero_stage} is not available: use 0, 1 (optimizer state sharded), "
                      "2 (also gradients) or 3 (also parameters)")
    if p.distributed_optimizer and p.zero_stage == 0:
        errors.append("parallel.distributed_optimizer=true is parallel.zero_stage=1, but parallel.zero_stage=0 is "
                      "set too; drop one of them")
    if p.overlap_param_gather and p.zero < 1:
        errors.append("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true "
                      "(only sharded parameters are gathered)")
    if p.bucket_size < 1:
        errors.append(f"parallel.bucket_size={p.bucket_size} must be >= 1")
    return errors


def _launch_hint(multiple: int) -> str:
    return (f"e.g. torchrun --nproc-per-node={multiple} pretrain_gpt.py ARGS (pretrain_gpt.py --check "
            "--nproc-per-node=N --nnodes=M ARGS checks a launch without starting it)")


def _check_context_parallel(cfg: Config) -> list[str]:
    p, m, errors = cfg.parallel, cfg.model, []
    if p.cp == 1:
        return errors
    split = 2 * p.cp * (p.tp if p.sequence_parallel_active else 1)
    if m.seq_length % split:
        errors.append(f"model.seq_length={m.seq_length} is not divisible by {split} = 2 * parallel.cp"
                      f"{' * parallel.tp (sequence parallelism)' if p.sequence_parallel_active else ''}: every "
                      "sample is cut into 2 * cp equal chunks; pick a seq_length or cp that divides")
    if m.attention_dropout:
        errors.append(f"model.attention_dropout={m.attention_dropout} with parallel.cp={p.cp}: context-parallel "
                      "attention has no dropout; set model.attention_dropout=0 (usual for pretraining)")
    return errors


def _check_pipeline(cfg: Config, world_size: int) -> list[str]:
    p, errors = cfg.parallel, []
    if p.vp > 1 and p.pp == 1:
        errors.append(f"parallel.vp={p.vp} needs pipeline parallelism (parallel.pp > 1)")
    try:
        chunk_layer_counts(cfg.model.num_layers, p.pp * p.vp, p.first_stage_layers if p.pp > 1 else None,
                           p.last_stage_layers if p.pp > 1 else None)
    except ValueError as err:
        errors.append(f"model.num_layers / parallel.pp, vp, first_stage_layers, last_stage_layers: {err}")
    spec = SCHEDULES.get(p.pipeline_schedule)
    if spec is None or not spec.trains:
        return errors + [f"parallel.pipeline_schedule={p.pipeline_schedule!r} is not a training schedule; use one of "
                         f"{', '.join(training_schedules())}"]
    known = world_size % (p.tp * p.cp * p.pp) == 0 and cfg.train.micro_batch_size > 0
    return errors + spec.problems(p.pp, p.vp, cfg.num_microbatches(world_size) if known else None)


def _check_train(cfg: Config, world_size: int) -> list[str]:
    t, errors = cfg.train, []
    if t.micro_batch_size < 1 or t.train_iters < 1:
        return [f"train.micro_batch_size={t.micro_batch_size} and train.train_iters={t.train_iters} must be >= 1"]
    p = cfg.parallel
    if world_size % (p.tp * p.cp * p.pp) == 0:
        dp = cfg.data_parallel_size(world_size)
        per_step = t.micro_batch_size * dp
        gbs = cfg.batch_size(world_size)
        if gbs % per_step:
            errors.append(f"train.global_batch_size={gbs} is not divisible by "
                          f"train.micro_batch_size*dp={t.micro_batch_size}*{dp}={per_step}; "
                          f"use a multiple of {per_step}")
    if t.param_dtype != "fp32" and t.param_dtype != t.precision:
        errors.append(f"train.param_dtype={t.param_dtype} needs train.precision={t.param_dtype} (got {t.precision}); "
                      "set both, or param_dtype=fp32")
    if t.max_skipped_steps < 1:
        errors.append(f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1")
    for name in ("exit_interval", "eval_interval", "exit_duration_mins"):
        if getattr(t, name) is not None and getattr(t, name) <= 0:
            errors.append(f"train.{name}={getattr(t, name)} must be positive or unset")
    return errors


def _check_optim(cfg: Config, world_size: int) -> list[str]:
    o, errors = cfg.optim, []
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        errors.append(f"need 0 <= optim.min_lr <= optim.lr and optim.lr > 0, got lr={o.lr} min_lr={o.min_lr}")
    decay = o.decay_iters or cfg.train.train_iters
    if o.warmup_iters < 0 or o.warmup_iters > decay:
        errors.append(f"optim.warmup_iters={o.warmup_iters} must be in [0, decay_iters={decay}]")
    if o.wsd_decay_iters is not None and not 0 <= o.wsd_decay_iters <= decay - o.warmup_iters:
        errors.append(f"optim.wsd_decay_iters={o.wsd_decay_iters} must be in "
                      f"[0, decay_iters - warmup_iters = {decay - o.warmup_iters}]")
    if o.clip_grad < 0 or o.weight_decay < 0:
        errors.append("optim.clip_grad and optim.weight_decay must be >= 0")
    if not 0 <= o.muon_momentum < 1:
        errors.append(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1) (0.95 as released)")
    if not 1 <= o.muon_ns_steps < 100:
        errors.append(f"optim.muon_ns_steps={o.muon_ns_steps} must be in [1, 99] (5 as released)")
    return errors + _check_qk_clip(cfg)


def _check_qk_clip(cfg: Config) -> list[str]:
    """QK-clip measures logits in plain causal attention, standard or latent (context-parallel too), on heads
    without q/k norms (a norm would undo the weights' scaling)."""
    threshold, m = cfg.optim.qk_clip_threshold, cfg.model
    if threshold is None:
        return []
    if threshold <= 0:
        return [f"optim.qk_clip_threshold={threshold} must be positive (Kimi K2 uses 100) or unset"]
    unsupported = [name for name, on in (("model.sliding_window", m.sliding_window is not None),
                                         ("attention sinks", m.features.attention_sinks),
                                         ("q/k norms (model.qk_norm)", m.features.qk_norm)) if on]
    return [f"optim.qk_clip_threshold does not work with {', '.join(unsupported)} yet: unset it"] if unsupported else []


def _check_checkpoint(cfg: Config, world_size: int) -> list[str]:
    c = cfg.checkpoint
    if c.save_interval is not None and c.save_interval < 1:
        return [f"checkpoint.save_interval={c.save_interval} must be >= 1 or unset"]
    if c.save_interval and not c.save:
        return ["checkpoint.save_interval is set but checkpoint.save is not; "
                "give a directory with --checkpoint.save=DIR"]
    if c.keep_last is not None and c.keep_last < 1:
        return [f"checkpoint.keep_last={c.keep_last} must be >= 1 or unset"]
    if c.load_timeout_minutes <= 0:
        return [f"checkpoint.load_timeout_minutes={c.load_timeout_minutes} must be > 0"]
    return []


def _check_data(cfg: Config, world_size: int) -> list[str]:
    d = cfg.data
    corpus = bool(d.paths or d.train_paths)
    if d.mock and corpus:
        named = [f"data.{name}" for name in ("paths", "train_paths", "valid_paths") if getattr(d, name)]
        unset = " ".join(f"--{name}=null" for name in named)
        return [f"data.mock=true and {', '.join(named)} are both set; choose one: {unset} for synthetic tokens, "
                "or --data.mock=false for the corpus"]
    if not d.mock and not corpus:
        return ["no training data: give --data.paths=PREFIX (from tools/preprocess_data.py) "
                "or --data.mock=true for synthetic tokens"]
    errors = []
    if d.paths and d.train_paths:
        errors.append("give either data.paths (split by data.split) or data.train_paths/valid_paths, not both")
    if corpus and not d.tokenizer_type:
        errors.append("data.tokenizer_type is required with a corpus (the one it was preprocessed with), "
                      "e.g. --data.tokenizer_type=GPT2BPETokenizer")
    if d.num_workers < 0:
        errors.append(f"data.num_workers={d.num_workers} must be >= 0")
    if d.blend_rule == "megatron":
        for name in ("paths", "train_paths", "valid_paths"):
            datasets = len(getattr(d, name) or []) // 2  # 'weight prefix' pairs
            if datasets > MAX_DATASETS:
                errors.append(f"data.{name} blends {datasets} datasets, but data.blend_rule=megatron follows "
                              f"Megatron-Core, which blends at most {MAX_DATASETS} (an int16 dataset index): "
                              "use data.blend_rule=megalite or fewer datasets")
    return errors


def _check_data_files(cfg: Config) -> list[str]:
    """Every corpus prefix names a .bin and an .idx file, and every blend parses: found here, before any
    process group forms, rather than as a traceback on one rank."""
    errors = []
    for name in ("paths", "train_paths", "valid_paths"):
        paths = getattr(cfg.data, name)
        if not paths or cfg.data.mock:
            continue
        try:
            prefixes = parse_blend(paths)[1]
        except ValueError as error:
            errors.append(f"data.{name}: {error}")
            continue
        for prefix in prefixes:
            missing = [f for f in (data_file_path(prefix), index_file_path(prefix)) if not os.path.isfile(f)]
            if missing:
                errors.append(f"data.{name}: {' and '.join(missing)} not found; give the prefix of a dataset "
                              "written by tools/preprocess_data.py (its path without .bin/.idx)")
    return errors


def _check_logging(cfg: Config, world_size: int) -> list[str]:
    log = cfg.logging
    errors = profile_config_errors(log, world_size)
    if log.log_interval < 1:
        errors.append(f"logging.log_interval={log.log_interval} must be >= 1")
    if log.wandb_timeout <= 0:
        errors.append(f"logging.wandb_timeout={log.wandb_timeout} must be > 0 seconds")
    if log.wandb_project and log.wandb_mode == "online" and not wandb_credentials():
        host = urlparse(os.environ.get("WANDB_BASE_URL", WANDB_HOST)).hostname
        errors.append(f"logging.wandb_mode=online but no W&B API key was found (WANDB_API_KEY is unset and "
                      f"{_netrc_path()} has no entry for {host}): run `wandb login`, "
                      "or export WANDB_API_KEY=<your key>, or pass --logging.wandb_mode=offline "
                      "and upload the run later with `wandb sync`")
    return errors


WANDB_HOST = "https://api.wandb.ai"


def _netrc_path() -> Path:
    return Path(os.environ.get("NETRC") or Path.home() / ".netrc")


def wandb_credentials() -> bool:
    """Whether W&B will find an API key: WANDB_API_KEY, or the netrc entry `wandb login` writes for the server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", WANDB_HOST)).hostname
    try:
        return netrc.netrc(_netrc_path()).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def profile_config_errors(cfg: LoggingConfig, world_size: int | None = None) -> list[str]:
    """Problems with the profiling fields, each with its fix (also checked by megalite.training.profiling.Profiler);
    ranks are checked against the world size when it is given."""
    errors = []
    steps = cfg.profile_steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        errors.append(f"logging.profile_steps={steps} must be [first, last] with 1 <= first <= last, e.g. [5, 6]")
    ranks = profile_ranks(cfg)
    bad = [r for r in ranks if r < 0 or (world_size is not None and r >= world_size)]
    if bad:
        errors.append(f"logging.profile_ranks={ranks} lists ranks outside the job (world size {world_size}); "
                      "use 0..world size - 1")
    if cfg.memory_snapshot and len(ranks) > 1 and "{rank}" not in cfg.memory_snapshot:
        errors.append(f"logging.memory_snapshot={cfg.memory_snapshot} is written by {len(ranks)} ranks; "
                      f"put '{{rank}}' in the path")
    return errors


def profile_ranks(cfg: LoggingConfig) -> list[int]:
    return [0] if cfg.profile_ranks is None else cfg.profile_ranks


_CHECKS = (_check_model, latent_attention_errors, mtp_errors, _check_moe, group_score_errors, _check_parallel,
           _check_train, fp8_errors, _check_optim, _check_data, _check_checkpoint, _check_logging)
