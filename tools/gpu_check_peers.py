"""tools/gpu_check.py's peers steps: megalite beside Megatron-Core and torchtitan on the same GPU in one run.

Each framework trains the same model at the same micro batch and sequence for a few steps on random tokens, in its
own trainer (megalite: pretrain_gpt.py; Megatron-Core: megatron.training.pretrain through
tools/peers/megatron_driver.py; torchtitan: its Trainer through tools/peers/torchtitan_driver.py), one process each
under torchrun. Two precision regimes, each peer set against megalite in its own:
  bf16      bf16 parameters, fp32 main weights and gradients in the optimizer: Megatron's --bf16 and megalite's
            train.param_dtype=bf16 (the examples' setting).
  autocast  fp32 parameters under bf16 autocast: torchtitan's only mode on one GPU (FSDP, its bf16-parameter path,
            needs more than one), megalite's train.param_dtype=fp32.
tokens/s is the median after the first PEER_WARMUP steps, each step timed between device synchronizations (the
drivers' `peer-step` lines; megalite's metrics file); MFU is tokens/s x megalite's training FLOPs of the model
each trained (megalite/training/flops.py) over the device's dense bf16 peak, the same peak for all.

The models: GPT-2 1.3B (examples/gpt2_1.3b.yaml at micro batch 4 x 2048) and Llama-3.2-1B's shape
(examples/llama_1b.yaml at micro batch 2 x 8192) with untied embeddings, as torchtitan cannot tie them.
torchtitan has no GPT-2: at GPT-2's shape it trains its Llama block (megalite's llama family at that shape).
Megatron-Core runs without Transformer Engine or apex (neither can travel to the GPU machine): its local layer
spec, torch's AdamW (its fallback) and its torch.compile'd bias-GELU / SwiGLU fusions; its attention either its
own unfused one (a lower bound; at Llama's 8192 tokens its probabilities, 8.6 GB a layer kept for backward, do
not fit the GPU) or torch's SDPA.
The wheels come from scripts/gpu_peer_wheels.sh (tools/peers/wheels.txt) in peer_wheels/, installed here with
pip --target into OUT/peer_site; without them the steps say how to get them.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from megalite.config import Config, ModelConfig
from megalite.planning.parameters import model_parameters
from megalite.training.flops import training_flops_per_token
from tools.gpu_check_report import CheckResult
from tools.gpu_check_steps import Context, display, failed, percent, pretrain_command, read_metrics, tail

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "tools" / "peers" / "wheels.txt"
PEER_STEPS, PEER_WARMUP = 12, 3
LIMIT, NEED = 180, 50  # seconds one run may take; seconds it needs at least (start-up, model build, a few steps)
REGIMES = {"bf16": "bf16 parameters, fp32 main weights", "autocast": "fp32 parameters under bf16 autocast"}
MODELS = {  # family: (label, example, the overrides that make the compared model)
    "gpt2": ("GPT-2 1.3B (mb 4 x 2048)", "examples/gpt2_1.3b.yaml", ["--train.micro_batch_size=4"]),
    "llama": ("Llama-3.2-1B shape, untied (mb 2 x 8192)", "examples/llama_1b.yaml",
              ["--train.micro_batch_size=2", "--model.tie_embeddings=false"]),
}
FRAMEWORKS = {"megalite": "megalite", "megatron-sdpa": "Megatron-Core (SDPA attention)",
              "megatron-local": "Megatron-Core (local attention)", "torchtitan": "torchtitan"}


@dataclass
class PeerRun:
    family: str
    framework: str  # a FRAMEWORKS key
    regime: str  # a REGIMES key
    command: list[str]
    cfg: Config  # megalite's config of the model this run trains: its FLOPs and parameter count
    metrics: Path | None = None  # megalite's metrics file

    @property
    def name(self) -> str:
        return f"peers_{self.family}_{self.framework}_{self.regime}"


def wheel_choices() -> list[list[str]]:
    """tools/peers/wheels.txt: each needed wheel as its choices (`name==version`, the first preferred)."""
    lines = (line.split("#")[0].replace(" ", "") for line in WHEEL_LIST.read_text().splitlines())
    return [line.split("|") for line in lines if line]


def wheel_files(wheels: Path) -> tuple[list[Path], list[str]]:
    """(the wheel files in `wheels` that the list names, the list's entries none of whose choices is there)."""
    found, missing = [], []
    for choices in wheel_choices():
        prefixes = [re.sub(r"[-_.]+", "_", spec.split("==")[0]).lower() + "-" + spec.split("==")[1] + "-"
                    for spec in choices]
        files = [path for prefix in prefixes for path in sorted(wheels.glob("*.whl")) if path.name.lower()
                 .startswith(prefix)]
        (found.append(files[0]) if files else missing.append(" or ".join(choices)))
    return found, missing


def install_command(files: list[Path], site: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
            "--upgrade", "--target", str(site), *map(str, files)]


def _torchrun(script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script]


def _megalite(family: str, regime: str, out: Path, steps: int) -> PeerRun:
    _, example, overrides = MODELS[family]
    metrics = out / f"peers_{family}_megalite_{regime}.jsonl"
    param_dtype = "bf16" if regime == "bf16" else "fp32"
    command, cfg = pretrain_command(example, family, metrics, steps, [*overrides, f"--train.param_dtype={param_dtype}"])
    return PeerRun(family, "megalite", regime, command, cfg, metrics)


def megatron_args(cfg: Config, steps: int) -> list[str]:
    """Megatron's command line for megalite's model and batch (bf16 parameters, the distributed optimizer as the
    examples use it). NullTokenizer adds one token to --vocab-size, hence the padded size less one."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    f = m.features
    args = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--num-attention-heads",
            m.num_attention_heads, "--ffn-hidden-size", m.ffn_size, "--seq-length", m.seq_length,
            "--max-position-embeddings", m.seq_length, "--tokenizer-type", "NullTokenizer", "--vocab-size",
            m.padded_vocab_size - 1, "--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by,
            "--micro-batch-size", t.micro_batch_size, "--global-batch-size", t.micro_batch_size,
            "--train-iters", steps, "--lr", o.lr, "--min-lr", o.min_lr, "--lr-warmup-iters", 2,
            "--lr-decay-style", "cosine", "--weight-decay", o.weight_decay, "--clip-grad", o.clip_grad,
            "--adam-beta1", o.adam_beta1, "--adam-beta2", o.adam_beta2, "--adam-eps", o.adam_eps,
            "--norm-epsilon", m.norm_epsilon, "--bf16", "--use-distributed-optimizer", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
            "--hidden-dropout", m.hidden_dropout, "--attention-dropout", m.attention_dropout, "--seed", t.seed,
            "--eval-iters", 0, "--eval-interval", steps + 1, "--log-interval", 1, "--num-workers", 1]
    if f.position_embedding == "rope":
        args += ["--position-embedding-type", "rope", "--rotary-base", int(m.rope_theta), "--no-rope-fusion"]
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    if f.norm == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if f.gated_mlp:
        args += ["--swiglu"]
    if not f.bias:
        args += ["--disable-bias-linear"]
    if m.kv_heads != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", m.kv_heads]
    if not m.tied:
        args += ["--untie-embeddings-and-output-weights"]
    return [str(arg) for arg in args]


def torchtitan_model_args(m: ModelConfig) -> dict:
    """torchtitan's TransformerModelArgs for a megalite llama-family model. Its SwiGLU width is rounded up from
    8/3 of the hidden size to a multiple of `multiple_of`: with multiple_of = megalite's width (which is at least
    that) it comes out exactly megalite's."""
    if m.ffn_size < int(8 * m.hidden_size / 3):
        raise ValueError(f"model.ffn_hidden_size={m.ffn_size}: torchtitan's Llama cannot be narrower than 8/3 of "
                         f"the hidden size ({int(8 * m.hidden_size / 3)})")
    return {"dim": m.hidden_size, "n_layers": m.num_layers, "n_heads": m.num_attention_heads,
            "n_kv_heads": m.kv_heads, "vocab_size": m.padded_vocab_size, "multiple_of": m.ffn_size,
            "norm_eps": m.norm_epsilon, "rope_theta": m.rope_theta}


def _torchtitan(family: str, out: Path, steps: int) -> PeerRun:
    """torchtitan's run: its Llama block, untied, at the model's shape (megalite's llama family there)."""
    _, example, overrides = MODELS[family]
    _, cfg = pretrain_command(example, "llama", out / "unused.jsonl", steps, [*overrides, "--model.family=llama",
                                                                              "--model.tie_embeddings=false"])
    t, o = cfg.train, cfg.optim
    titan = ["--model.name", "megalite_peer", "--model.flavor", "peer", "--training.local_batch_size",
             str(t.micro_batch_size), "--training.seq_len", str(cfg.model.seq_length), "--training.steps", str(steps),
             "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--optimizer.lr", str(o.lr),
             "--optimizer.eps", str(o.adam_eps), "--optimizer.weight_decay", str(o.weight_decay),
             "--lr_scheduler.warmup_steps", "2", "--training.max_norm", str(o.clip_grad), "--job.dump_folder",
             str(out / f"torchtitan_{family}")]
    command = [*_torchrun("tools/peers/torchtitan_driver.py"), "--model-args",
               json.dumps(torchtitan_model_args(cfg.model)), "--", *titan]
    return PeerRun(family, "torchtitan", "autocast", command, cfg)


def _megatron(family: str, attention: str, out: Path, steps: int) -> PeerRun:
    _, example, overrides = MODELS[family]
    _, cfg = pretrain_command(example, family, out / "unused.jsonl", steps, overrides)
    command = [*_torchrun("tools/peers/megatron_driver.py"), "--attention", attention, "--",
               *megatron_args(cfg, steps)]
    return PeerRun(family, f"megatron-{attention}", "bf16", command, cfg)


def peer_runs(out: Path, steps: int = PEER_STEPS) -> list[PeerRun]:
    """The peers step's runs, most wanted first: per model, each peer right after megalite in its regime, so that
    a budget cut leaves whole pairs. Raises ConfigError for an invalid config."""
    runs = []
    for family in MODELS:
        runs += [_megalite(family, "bf16", out, steps), _megatron(family, "sdpa", out, steps),
                 _megalite(family, "autocast", out, steps), _torchtitan(family, out, steps)]
    return runs


def local_attention_runs(out: Path, steps: int = PEER_STEPS) -> list[PeerRun]:
    """Megatron-Core with its own unfused attention, at GPT-2 1.3B only (see the module docstring)."""
    return [_megatron("gpt2", "local", out, steps)]


def parse_peer_steps(output: str) -> list[tuple[float, int, float]]:
    """(seconds, tokens, peak allocated GiB) of each `peer-step` line of a driver's output."""
    return [(float(s), int(n), float(g)) for s, n, g in re.findall(r"^peer-step ([\d.]+) (\d+) ([\d.]+)$", output,
                                                                     re.M)]


def parse_parameters(output: str) -> int | None:
    found = re.search(r"^peer-model parameters=(\d+)", output, re.M)
    return int(found.group(1)) if found else None


def measure(run: PeerRun, output: str) -> tuple[float | None, float | None, int | None]:
    """(tokens/s: the median after PEER_WARMUP steps, peak allocated GiB, parameter count) of a finished run."""
    if run.metrics is not None:
        records = read_metrics(run.metrics)[PEER_WARMUP:]
        tokens = statistics.median(r["tokens_per_sec"] for r in records) if records else None
        peak = max((r["peak_memory_gib"] for r in records), default=None)
        return tokens, peak, model_parameters(run.cfg.model)
    steps = parse_peer_steps(output)[PEER_WARMUP:]
    tokens = statistics.median(n / s for s, n, _ in steps) if steps else None
    return tokens, max((g for *_, g in steps), default=None), parse_parameters(output)


def install_wheels(ctx: Context, wheels: Path) -> tuple[Path | None, str]:
    """Install the peers' wheels into OUT/peer_site (once per check): (that folder, '') or (None, why not)."""
    site = ctx.out / "peer_site"
    if (site / ".installed").exists():
        return site, ""
    files, missing = wheel_files(wheels)
    if missing:
        return None, (f"no wheel of {', '.join(missing)} in {wheels}: run `bash scripts/gpu_peer_wheels.sh` where "
                      f"a package registry is reachable, and bring its folder ({wheels.name}/) to this machine")
    rc, output = ctx.run("peers_install", install_command(files, site), 120)
    if rc != 0:
        return None, f"pip install of the peers' wheels: {failed(rc)}: {' '.join(output.split()[-30:])}"
    site.mkdir(parents=True, exist_ok=True)
    (site / ".installed").write_text("\n".join(file.name for file in files) + "\n")
    return site, ""


def peer_dry_run(runs: list[PeerRun], wheels: Path) -> list[str]:
    """What the peers steps would run: the wheels, then each command and the model it trains."""
    files, missing = wheel_files(wheels)
    lines = [f"wheels ({display([str(WHEEL_LIST)])}; `bash scripts/gpu_peer_wheels.sh` fetches them into "
             f"{display([str(wheels)])}):", *(f"  {' | '.join(c)}" for c in wheel_choices()),
             f"  here: {len(files)} found" + (f", missing: {', '.join(missing)}" if missing else "")]
    if files:
        lines.append(f"$ {display(install_command(files, Path('OUT/peer_site')))}")
    for run in runs:
        flops = training_flops_per_token(run.cfg.model)
        lines += [f"$ {display(run.command)}", f"  {MODELS[run.family][0]}, {FRAMEWORKS[run.framework]}, "
                  f"{REGIMES[run.regime]}: {model_parameters(run.cfg.model) / 1e9:.3f}B parameters, "
                  f"{flops / 1e9:.2f} GFLOP/token"]
    return lines


def run_peers(ctx: Context, step: str, runs: list[PeerRun], wheels: Path) -> CheckResult:
    """Each run (megalite's without the wheels) in turn, within the budget; a failed run is a row with its log's
    end, never the end of the check."""
    site, why = (None, "") if all(r.framework == "megalite" for r in runs) else install_wheels(ctx, wheels)
    rows, problems, skips, logs, measured = [], [], [], [], {}
    for run in runs:
        label = f"{MODELS[run.family][0]}, {FRAMEWORKS[run.framework]} ({run.regime})"
        if run.framework != "megalite" and site is None:
            skips.append(f"{label}: {why}")
            continue
        skipped = ctx.skip(label, NEED)
        if skipped:
            skips.append(f"{label}: {skipped}")
            continue
        if run.metrics is not None:
            run.metrics.unlink(missing_ok=True)  # the metrics writer appends
        rc, output = ctx.run(run.name, run.command, LIMIT, [site] if site else [])
        tokens, peak, parameters = measure(run, output)
        if rc != 0 or tokens is None:
            problems.append(f"{label}: {failed(rc) if rc != 0 else 'no timed steps'}")
            logs += ["", f"{label}, the end of its output:", *tail(output, 25)]
            continue
        measured[run.family, run.framework, run.regime] = tokens, run.cfg.model
        rows.append(_row(ctx, run, tokens, peak, parameters, measured.get((run.family, "megalite", run.regime))))
    details = [f"Each framework's own trainer, one GPU, random tokens, {PEER_STEPS} steps; tokens/s the median "
               f"after {PEER_WARMUP}; MFU = tokens/s x megalite's training FLOPs of the model each ran over "
               f"{ctx.peak or 'an unknown'} TFLOP/s (bf16 dense peak, the same for all). Precision: "
               + "; ".join(f"{k}: {v}" for k, v in REGIMES.items()) + ". megalite x: its tokens/s over the peer's "
               "in the same regime (its MFU over the peer's where the peer trains another model: torchtitan's Llama "
               "block at GPT-2's shape).", "",
               "| model | framework | precision | tokens/s | MFU | peak GiB | megalite x | parameters |",
               "|---|---|---|---:|---:|---:|---:|---|", *rows, *(["", *(f"- {s}" for s in skips)] if skips else []),
               "", "Commands:", "", *(f"    {display(run.command)}" for run in runs), *logs]
    summary = "; ".join(problems) or "; ".join(
        f"{MODELS[f][0].split(' (')[0]} {FRAMEWORKS[fw]} {t:,.0f} tok/s" for (f, fw, _), (t, _) in measured.items()
        if fw != "megalite") or "; ".join(skips)
    status = "FAIL" if problems else "PASS" if rows else "SKIP"
    return CheckResult(step, status, summary, details)


def _row(ctx: Context, run: PeerRun, tokens: float, peak: float | None, parameters: int | None,
         megalite: tuple[float, ModelConfig] | None) -> str:
    """A run's row; `megalite`: megalite's tokens/s and model in the same regime, if it ran."""
    flops = training_flops_per_token(run.cfg.model)
    mfu = tokens * flops / (ctx.peak * 1e12) if ctx.peak else None
    expected = model_parameters(run.cfg.model)
    same = "n/a" if parameters is None else f"{parameters / 1e9:.3f}B" + (
        "" if parameters == expected else f" (megalite's model: {expected / 1e9:.3f}B)")
    ratio = ""
    if run.framework != "megalite" and megalite:
        work = megalite[0] * training_flops_per_token(megalite[1]) / (tokens * flops)
        ratio = f"{megalite[0] / tokens:.2f}x" if megalite[1] == run.cfg.model else f"{work:.2f}x (MFU)"
    model = MODELS[run.family][0] + (" as a Llama block" if run.cfg.model.family != run.family else "")
    return (f"| {model} | {FRAMEWORKS[run.framework]} | {run.regime} | {tokens:,.0f} | {percent(mfu)} | "
            f"{'n/a' if peak is None else f'{peak:.2f}'} | {ratio} | {same} |")
