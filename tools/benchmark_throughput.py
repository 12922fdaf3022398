"""Training throughput of megalite against Hugging Face's GPT2LMHeadModel or LlamaForCausalLM, in one run.

Both sides train the same network (`--family`: same shapes, fp32 parameters, bf16 = autocast
in both) on the same token batches with the same AdamW hyperparameters, parameter groups
and gradient clipping, so the ratio of their tokens/s measures the two codebases' model and
step code. megalite runs its real step (`megalite.training.step.train_step`); Hugging Face runs
the loop its Trainer runs: `model(input_ids, labels=input_ids).loss`, backward,
`clip_grad_norm_`, `optimizer.step()`, with the optimizer Trainer defaults to on
torch >= 2.8 (`adamw_torch_fused`: torch AdamW with fused=True, as megalite uses on
CPUs), or with `--hf-optimizer=default` torch AdamW's default implementation (Trainer's
older `adamw_torch`: a per-tensor loop on CPU, foreach on CUDA). Hugging Face's attention is
SDPA (attn_implementation="sdpa", asked for explicitly, so that no silent fallback to its eager
attention slows it down). `--compile` compiles megalite as train.compile does (each layer);
`--hf-compile` compiles the whole HF model, as Trainer's torch_compile and most users do; the
two are independent, so eager and compiled can each be set against their like.

Parameters stay fp32 on both sides: megalite's train.param_dtype=bf16 (bf16 parameters, fp32
main weights in the optimizer) has no counterpart in Trainer, whose bf16 is autocast over fp32
parameters; an HF model loaded in bf16 would train without fp32 main weights, another algorithm.

`--plain` adds a third side: megalite's own model in a bare PyTorch loop (forward, backward,
clipping, fused AdamW), so the gap between it and megalite's side is the host work megalite's
step adds (gradient buffers, hooks, the schedule, the step's bookkeeping), which a GPU pays for
on small and medium models. The side `unfused` is megalite with train.fusions=false (norms as
autocast runs them, eager SwiGLU and RoPE; model/fused.py): `--sides megalite unfused` measures
the fusions against the eager forms in one process, on the same batch.

MFU is taken against a peak measured on the spot (a large matmul in the run's dtype on
this device), not a datasheet figure, so it is meaningful on CPUs too.

Example (the defaults are the goal config of docs/benchmarks.md):
    python tools/benchmark_throughput.py --precision bf16
    python tools/benchmark_throughput.py --family gpt2 --layers 4 --hidden 128 --heads 4 --seq 64 --micro-batch 12 \\
        --vocab 50304 --precision fp32 --plain   # nanoGPT's CPU recipe shape
    python tools/benchmark_throughput.py --device cuda --layers 24 --hidden 1024 --heads 16 --seq 1024
    python tools/benchmark_throughput.py --device cuda --family llama --layers 16 --hidden 2048 --heads 32 \\
        --kv-heads 8 --ffn 8192 --seq 8192 --micro-batch 2 --vocab 128256 --tie-embeddings --compile --hf-compile
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script Python puts tools/ first, not the root
from megalite.checkpoint.hf_config import hf_config  # noqa: E402
from megalite.config import Config  # noqa: E402
from megalite.data.batches import Batch  # noqa: E402
from megalite.parallel.distributed_optimizer import adamw, decay_groups  # noqa: E402
from megalite.parallel.topology import Topology, release_process_groups, synchronize  # noqa: E402
from megalite.planning.measure import measurement_config, mock_batches, model_fields  # noqa: E402
from megalite.training.build import build_rank_model, build_trainer  # noqa: E402
from megalite.training.flops import training_flops_per_token  # noqa: E402
from megalite.training.step import precision_context, train_step  # noqa: E402
from tools import profile_summary  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("gpt2", "llama", "qwen3"), default="gpt2",
                   help="megalite's model family, against its HF class: GPT2LMHeadModel, LlamaForCausalLM "
                        "(MixtralForCausalLM with --experts), Qwen3ForCausalLM (Qwen3MoeForCausalLM with --experts)")
    p.add_argument("--precision", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model before timing")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None,
                   help="llama: key/value heads of grouped-query attention (default: --heads)")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default: the family's, model.ffn_hidden_size)")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the input embedding and the LM head (default: the family's, gpt2 tied, llama not)")
    p.add_argument("--rope-theta", type=float, default=None,
                   help="llama: RoPE base frequency (default: model.rope_theta's); changes values, not speed")
    p.add_argument("--experts", type=int, default=None, help="routed experts per layer (model.num_experts)")
    p.add_argument("--topk", type=int, default=None, help="experts per token (model.moe_topk)")
    p.add_argument("--expert-ffn", type=int, default=None, help="each expert's width (model.moe_ffn_hidden_size)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile each megalite layer, as train.compile does")
    p.add_argument("--hf-compile", action="store_true",
                   help="torch.compile the whole Hugging Face model, as Trainer's torch_compile does")
    p.add_argument("--hf-optimizer", choices=("fused", "default"), default="fused",
                   help="fused: Trainer's default adamw_torch_fused; default: torch AdamW's default implementation")
    p.add_argument("--plain", action="store_true",
                   help="also time megalite's model in a plain PyTorch loop (forward, backward, clipping, torch's "
                        "fused AdamW, nothing else): the gap to megalite's side is what its step adds on the host")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one more step of each side: its N ops with the most self time, and "
                        "the share of matmuls (which both sides run alike) in the step")
    p.add_argument("--sides", nargs="+", choices=("megalite", "huggingface", "plain", "unfused"), default=None,
                   help="which sides to time (default: megalite and huggingface, and plain with --plain); unfused: "
                        "megalite with train.fusions=false")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="megalite's parameters (train.param_dtype; bf16 keeps fp32 main weights in the optimizer); "
                        "Hugging Face's stay fp32 under autocast")
    p.add_argument("--profile-json", type=Path, default=None, metavar="PATH",
                   help="profile one more step of each side and write where its time goes (tools/profile_summary.py: "
                        "kernel families, launch gaps, host syncs and where they come from) to PATH as JSON")
    p.add_argument("--profile-trace", type=Path, default=None, metavar="PATH",
                   help="with --profile-json, also each side's chrome trace of that step, gzipped: PATH with the "
                        "side's name before its suffixes (trace.json.gz -> trace_megalite.json.gz)")
    args = p.parse_args(argv)
    args.sides = args.sides or ["megalite", "huggingface", *(["plain"] if args.plain else [])]
    if args.profile_trace and not args.profile_json:
        p.error("--profile-trace needs --profile-json (the trace is of the step that one profiles)")
    if args.family == "gpt2" and (args.kv_heads is not None or args.rope_theta is not None):
        p.error("--kv-heads and --rope-theta are llama options: GPT2LMHeadModel has neither")
    if args.family == "gpt2" and args.experts:
        p.error("--experts: GPT-2 has no Hugging Face mixture-of-experts class; use --family llama or qwen3")
    return args


def build_config(args: argparse.Namespace) -> Config:
    """The validated megalite config of the benchmarked model (one process, mock data); the model options left out
    and the optimizer hyperparameters stay at their defaults."""
    return measurement_config(1, model={"family": args.family, **model_fields(args)},
                              train={"micro_batch_size": args.micro_batch, "precision": args.precision,
                                     "param_dtype": args.param_dtype, "compile": args.compile, "seed": args.seed,
                                     "device": args.device})


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, size: int = 4096, rounds: int = 5) -> float:
    """Achieved TFLOP/s of square `size` matmuls in `dtype`: the ceiling MFU is measured against.

    Each round times enough back-to-back matmuls to fill ~0.2 s (one on a CPU, hundreds
    on a GPU, where one is too short to time); the fastest round counts, as the ceiling is
    what the device does when nothing else gets in the way.
    """
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))

    def seconds(count: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        synchronize(device)
        return time.perf_counter() - start

    seconds(1)
    count = max(1, round(0.2 / seconds(1)))
    return 2 * size**3 * count / min(seconds(count) for _ in range(rounds)) / 1e12


def median_step_seconds(step: Callable[[], None], warmup: int, timed: int, device: torch.device) -> float:
    """Median seconds per call of `step` after `warmup` untimed calls.

    The median ignores the odd step that a neighbouring process on a shared machine slowed
    down. The two models are timed one after the other, not in turns: on CPUs a step's
    cost includes page faults on freshly allocated memory, and alternating two models'
    allocation patterns changes that cost for both.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def megalite_step(cfg: Config, topology: Topology, batch: Batch) -> Iterator[Callable[[], None]]:
    """One megalite optimizer step as pretraining runs it (model, optimizer, compile as pretrain.py builds them);
    the trainer is closed when the measurement is done."""
    with build_trainer(cfg, topology) as trainer:
        trainer.model.train()
        yield lambda: train_step(trainer, [batch])


@contextlib.contextmanager
def plain_step(cfg: Config, topology: Topology, batch: Batch) -> Iterator[Callable[[], None]]:
    """megalite's own model, built as build_trainer builds it, in the loop a plain PyTorch script runs: zero the
    grads, forward, the mean loss over the batch's positions, backward, clip, torch's fused AdamW. No gradient
    buffers, hooks, schedule or step bookkeeping: the baseline of what megalite's step costs beyond its model."""
    model = build_rank_model(cfg, topology).train()
    o, device = cfg.optim, topology.device
    optimizer = adamw(decay_groups(((n, p, p) for n, p in model.named_parameters()), o.weight_decay), o)
    tokens, labels, mask = (t.to(device) for t in (batch.tokens, batch.labels, batch.loss_mask))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model.aux_losses.start_step(1.0, device)
        with precision_context(cfg.train.precision, device):
            loss = (model(tokens, labels) * mask).sum() / mask.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()

    yield step


def hf_step(cfg: Config, device: torch.device, batch: Batch, fused: bool, compiled: bool) -> Callable[[], None]:
    """One step of the loop Trainer runs, on the same network, batch and AdamW settings as megalite.

    Labels are the inputs, as HF models shift them inside: the forward pass sees the same
    tokens as megalite's, and the last position is left out of the loss. `compiled` compiles
    the whole model, its loss included; the optimizer is built on the model's own parameters.
    """
    torch.manual_seed(cfg.train.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model), attn_implementation="sdpa")
    model = model.to(device).train()
    o = cfg.optim
    groups = decay_groups(((n, p, p) for n, p in model.named_parameters()), o.weight_decay)
    optimizer = adamw(groups, o) if fused else torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                                                 eps=o.adam_eps)
    tokens = batch.tokens.to(device)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision_context(cfg.train.precision, device):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()

    return step


MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")


def profile_step(step: Callable[[], None], rows: int) -> tuple[str, float, float]:
    """(table of the `rows` ops with the most self time, matmul seconds, all seconds) of one call of `step`.

    The matmuls' share bounds what any code outside them can gain: the same network runs the same matmuls on both
    sides, so a step can be at most all / matmul times faster than another that has no overhead at all."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *(
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]) as prof:
        step()
    events = prof.key_averages()
    device = torch.cuda.is_available() and any(e.self_device_time_total for e in events)

    def self_us(e) -> float:
        return e.self_device_time_total if device else e.self_cpu_time_total

    table = events.table(sort_by="self_device_time_total" if device else "self_cpu_time_total", row_limit=rows,
                         max_name_column_width=48)
    return (table, sum(self_us(e) for e in events if e.key in MATMULS) / 1e6, sum(self_us(e) for e in events) / 1e6)


def trace_path(path: Path | None, side: str) -> Path | None:
    """`path` with the side's name before its suffixes, or None."""
    if path is None:
        return None
    stem = path.name.split(".")[0]
    return path.with_name(f"{stem}_{side}{path.name[len(stem):]}")


def summarize_step(step: Callable[[], None], device: torch.device, trace: Path | None) -> dict:
    """Where one more call of `step` spends its time (tools/profile_summary.py), then where its host syncs come
    from, from another call recorded with Python stacks (kept apart: recording stacks slows the host)."""
    activities = [torch.profiler.ProfilerActivity.CPU, *(
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    synchronize(device)
    with torch.profiler.profile(activities=activities) as timed:
        step()
        synchronize(device)
    if trace is not None:
        with tempfile.TemporaryDirectory() as folder:
            raw = Path(folder) / "trace.json"
            timed.export_chrome_trace(str(raw))
            trace.parent.mkdir(parents=True, exist_ok=True)
            with raw.open("rb") as source, gzip.open(trace, "wb") as target:
                shutil.copyfileobj(source, target)
    with torch.profiler.profile(activities=activities, with_stack=True) as stacked:
        step()
        synchronize(device)
    return profile_summary.summarize(profile_summary.records_of(timed.events()),
                                     profile_summary.sync_sites_of(stacked.events()))


def write_summaries(path: Path, args: argparse.Namespace, summaries: dict[str, dict]) -> None:
    """The profiled sides' summaries and the benchmark's shape, rewritten after each side (a run cut off keeps
    the sides it finished)."""
    shape = {key: getattr(args, key) for key in ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "seq",
                                                 "micro_batch", "vocab", "precision", "param_dtype", "compile")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": shape, "sides": summaries}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = build_config(args)
    created = not dist.is_initialized()
    topology = Topology.from_environment(args.device, cfg.parallel, experts=cfg.model.num_experts > 0)
    try:
        compare(args, cfg, topology)
    finally:
        if created:
            topology = None
            release_process_groups()


def compare(args: argparse.Namespace, cfg: Config, topology: Topology) -> None:
    """Time both sides (and the plain loop) on one batch and print each one's speed and the ratio."""
    device = topology.device
    batch = mock_batches(cfg, 1)[0]

    peak = measure_peak_tflops(device, _DTYPES[args.precision])
    flops_per_token = training_flops_per_token(cfg.model)
    tokens_per_step = args.micro_batch * args.seq
    print(f"device {device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    m = cfg.model
    experts = f" experts={m.num_experts} top{m.moe_topk} expert_ffn={m.expert_ffn_size}" if m.num_experts else ""
    print(f"model {m.family} L={m.num_layers} h={m.hidden_size} heads={m.num_attention_heads} kv={m.kv_heads} "
          f"ffn={m.ffn_size}{experts} tied={m.tied} seq={m.seq_length} mb={args.micro_batch} vocab={m.vocab}, "
          f"precision {args.precision}, {flops_per_token / 1e6:.1f} MFLOP/token")
    print(f"compiled: megalite {'each layer' if args.compile else 'no'}, huggingface "
          f"{'whole model' if args.hf_compile else 'no'}; HF attention sdpa, HF optimizer {args.hf_optimizer}")
    print(f"measured matmul peak: {peak:.3f} TFLOP/s ({args.precision}, {device.type})")

    unfused = copy.deepcopy(cfg)
    unfused.train.fusions = False
    builders = {"megalite": lambda: megalite_step(cfg, topology, batch),
                "unfused": lambda: megalite_step(unfused, topology, batch),
                "huggingface": lambda: contextlib.nullcontext(
                    hf_step(cfg, device, batch, args.hf_optimizer == "fused", args.hf_compile)),
                "plain": lambda: plain_step(cfg, topology, batch)}
    tokens_per_s, summaries = {}, {}
    for name in args.sides:
        with builders[name]() as step:
            seconds = median_step_seconds(step, args.warmup, args.steps, device)
            if args.profile:
                table, matmul, total = profile_step(step, args.profile)
                print(f"{name} profile of one step:\n{table}\n{name} matmuls: {matmul * 1e3:.2f} ms of "
                      f"{total * 1e3:.2f} ms self time ({matmul / total:.0%})", flush=True)
            if args.profile_json:
                summaries[name] = summarize_step(step, device, trace_path(args.profile_trace, name))
                write_summaries(args.profile_json, args, summaries)
        tokens_per_s[name] = tokens_per_step / seconds
        mfu = tokens_per_s[name] * flops_per_token / (peak * 1e12)
        print(f"{name:<12} {seconds * 1e3:8.1f} ms/step {tokens_per_s[name]:10.1f} tokens/s  MFU {mfu:6.1%}",
              flush=True)
        gc.collect()
        torch.cuda.empty_cache()  # the next model starts from a bare allocator, as in a process of its own
    for other in ("huggingface", "plain", "unfused"):
        if {"megalite", other} <= tokens_per_s.keys():
            print(f"megalite / {other}: {tokens_per_s['megalite'] / tokens_per_s[other]:.3f}x")


if __name__ == "__main__":
    main()
