"""The sections of a run's configuration about its data, its checkpoints and its logging (config.py holds the
model, parallel, training and optimizer sections, and the Config that gathers them all)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def documented(default: Any, doc: str) -> Any:
    """A config field with its default and its one-line doc (--help prints it)."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class DataConfig:
    mock: bool = documented(
        False, "synthetic tokens, a deterministic function of train.seed and the global sample index "
               "(no corpus needed)")
    paths: list[str] | None = documented(
        None, "blend of preprocessed prefixes: [0.7, /data/a_text_document, 0.3, /data/b_text_document] or one prefix")
    split: str = documented("969,30,1", "train,valid,test weights over the documents of data.paths")
    train_paths: list[str] | None = documented(None, "training blend, instead of splitting data.paths")
    valid_paths: list[str] | None = documented(None, "validation blend, instead of splitting data.paths")
    blend_rule: Literal["megalite", "megatron"] = documented(
        "megalite", "how a blend is sized and ordered: megalite (every share provably within (1 + (D - 2) * w) / 2 "
                    "samples of its weight; datasets sized never to run dry) or megatron (Megatron-Core's sizes and "
                    "order exactly, to continue a Megatron-LM run on the batches it would have trained on)")
    cache_dir: str | None = documented(
        None, "where index files (.npy) are cached (default: a cache/ folder next to the first prefix)")
    tokenizer_type: (Literal["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer"]
                     | None) = documented(
        None, "tokenizer the corpus was preprocessed with; sets model.vocab_size unless the config or the "
              "checkpoint continued does (its ids must fit in it)")
    vocab_file: str | None = documented(None, "GPT2BPETokenizer: vocab.json")
    merge_file: str | None = documented(None, "GPT2BPETokenizer: merges.txt")
    tokenizer_model: str | None = documented(
        None, "SentencePiece .model file, or a Hugging Face tokenizer directory / tokenizer.json")
    reset_position_ids: bool = documented(False, "restart position ids after every end-of-document token")
    eod_mask_loss: bool = documented(False, "no loss on predictions made from an end-of-document token")
    num_workers: int = documented(2, "background data-loading processes per rank (0 loads in the training process)")


@dataclass
class CheckpointConfig:
    save: str | None = documented(None, "directory to save checkpoints into (iter_XXXXXXX/ and a latest file)")
    load: str | None = documented(
        None, "start from this directory's latest complete checkpoint, or from exactly this iter_XXXXXXX directory "
              "(a converted model, another run); once checkpoint.save holds a checkpoint, a relaunch resumes there "
              "instead (default: checkpoint.save, so a restarted job resumes)")
    save_interval: int | None = documented(None, "save every this many steps (and at the end of training)")
    async_save: bool = documented(
        False, "write checkpoint files in a background thread; training stalls only to copy state to host memory")
    keep_last: int | None = documented(
        None, "keep only this many newest checkpoints (older ones deleted after a newer one is complete)")
    fallback: bool = documented(
        True, "if the latest checkpoint is damaged (missing, truncated or corrupt file), "
              "resume from the previous complete one")
    load_optimizer: bool = documented(
        True, "false: resume the weights only and start Adam's moments and step afresh (Megatron-LM's --no-load-optim)")
    load_timeout_minutes: float = documented(
        60.0, "how long ranks that finished reading a checkpoint wait for the slowest one (through the store, "
              "not a collective)")


@dataclass
class LoggingConfig:
    log_interval: int = documented(10, "steps between metric lines")
    metrics_file: str | None = documented(None, "append one JSON object per logged step to this file")
    pipeline_trace: str | None = documented(
        None, "write the first pipeline_trace_steps steps' schedule "
              "(every forward/backward of every rank) to this Chrome-trace JSON")
    pipeline_trace_steps: int = documented(2, "how many steps the pipeline trace records")
    progress_bar: bool = documented(True, "show a progress bar on the logging rank")
    peak_tflops: float | None = documented(
        None, "per-device peak TFLOP/s for MFU (default: table lookup by device; n/a when unknown)")
    wandb_project: str | None = documented(None, "Weights & Biases project; none disables W&B")
    wandb_entity: str | None = documented(None, "W&B entity (team or user)")
    wandb_name: str | None = documented(None, "W&B run name")
    wandb_mode: Literal["online", "offline", "disabled"] = documented(
        "online", "offline writes the run locally for a later `wandb sync`")
    wandb_dir: str | None = documented(None, "where W&B writes its files (default: checkpoint.save, else ./wandb)")
    wandb_timeout: float = documented(
        30.0, "seconds W&B may hold up the run: an online start that takes longer falls back to offline, "
              "and the end of training waits at most this long for W&B to finish")
    profile_steps: list[int] | None = documented(
        None, "[a, b]: record a torch.profiler trace of steps a..b (inclusive) on logging.profile_ranks")
    profile_ranks: list[int] | None = documented(None, "global ranks that profile (default: [0])")
    profile_dir: str = documented(
        "profiles", "where profiler traces go: rank<R>_steps<a>-<b>.pt.trace.json (Chrome trace) and .txt "
                    "(top operators)")
    memory_snapshot: str | None = documented(
        None, "CUDA only: record the allocator's history from start-up and dump it to this pickle after profile_steps "
              "(default: step 2) or at exit; '{rank}' in the path is replaced by the rank")
