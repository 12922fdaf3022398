"""Does FP8 train like bf16? One model trained from the same seed on the same data in bf16 (train.fp8_recipe=none)
and in each FP8 recipe, and the gap between the loss curves as a table.

    python tools/fp8_convergence.py --steps 200                   # a tiny Llama on this machine's CPU
    python tools/fp8_convergence.py --shape llama3_8b_cut --device cuda --compile --steps 30 --eval-iters 2
                                                                  # tools/gpu_check.py's FP8 step

Every run is pretrain_gpt.py's training (megalite.training.pretrain, in this process, one run after the other),
mock data (samples that repeat a random motif: a curve that falls well below log(vocab), the same samples for every
recipe), a validation loss at the last step, a metrics file per recipe in --out (OUT/<recipe>.jsonl). The gap of a
recipe: |loss - bf16's loss| / bf16's loss at each step (the same batch at the same step), its largest over the
run and at the last step, and the last validation loss's. Extra arguments after `--` go to every run (e.g.
`-- --data.mock=false --data.paths=[...]` for a real corpus). Shapes:

  tiny           Llama, 2 layers, hidden 128 (every contracted width whole 128-tiles, so blockwise tiles it),
                 vocab 256, 4 x 128 tokens per step
  llama3_8b_cut  Llama-3.1-8B's layer (hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) cut to 6 layers
                 and 4096-token samples so that one 80 GB GPU holds it with bf16 parameters and fp32 Adam
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # as a script Python puts tools/ on the path, not the repository root

RECIPES = ("none", "tensorwise", "rowwise", "blockwise")  # none: bf16, the reference
WARMUP_STEPS = 2  # logged steps left out of tokens/s: start-up, allocator warm-up, compiling
SHAPES = {
    "tiny": ["--model.family=llama", "--model.num_layers=2", "--model.hidden_size=128",
             "--model.num_attention_heads=2", "--model.num_query_groups=2", "--model.ffn_hidden_size=256",
             "--model.seq_length=128", "--model.vocab_size=256", "--train.micro_batch_size=4",
             "--optim.lr=3e-3", "--optim.min_lr=3e-4"],
    "llama3_8b_cut": ["--config", str(ROOT / "examples/llama_8b.yaml"), "--model.num_layers=6",
                      "--model.seq_length=4096", "--parallel.tp=1", "--parallel.pp=1",
                      "--parallel.sequence_parallel=false", "--parallel.distributed_optimizer=false",
                      "--train.micro_batch_size=1", "--data.paths=null", "--checkpoint.save=null",
                      "--checkpoint.save_interval=null"],
}


@dataclass
class Curve:
    """One recipe's run, from its metrics file."""

    recipe: str
    losses: list[float]
    val_loss: float | None
    tokens_per_sec: float | None  # the median after WARMUP_STEPS


def run_args(shape: str, recipe: str, steps: int, device: str, compile_: bool, precision: str, eval_iters: int,
             metrics: Path, extra: list[str] = ()) -> list[str]:
    """pretrain_gpt.py's arguments for one recipe's run."""
    return [*SHAPES[shape], "--data.mock=true", "--data.num_workers=0", f"--train.device={device}",
            f"--train.precision={precision}", f"--train.fp8_recipe={recipe}", f"--train.train_iters={steps}",
            "--train.global_batch_size=null", f"--train.eval_interval={steps}", f"--train.eval_iters={eval_iters}",
            f"--train.compile={str(compile_).lower()}", f"--optim.warmup_iters={max(1, steps // 10)}",
            "--logging.wandb_project=null", "--logging.log_interval=1", "--logging.progress_bar=false",
            f"--logging.metrics_file={metrics}", *extra]


def read_curve(path: Path, recipe: str) -> Curve | None:
    """The curve in a metrics file (None when the run wrote none)."""
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    validation = [r["val_loss"] for r in records if "val_loss" in r]
    speeds = [r["tokens_per_sec"] for r in steps[WARMUP_STEPS:] if r.get("tokens_per_sec")]
    return Curve(recipe, [r["loss"] for r in steps], validation[-1] if validation else None,
                 statistics.median(speeds) if speeds else None)


def gaps(reference: Curve, curve: Curve) -> tuple[float, float, float | None]:
    """(largest, last) relative gap of the step losses to the reference's, over the steps both logged, and the
    last validation loss's (None without both)."""
    pairs = list(zip(reference.losses, curve.losses))
    if not pairs:
        raise ValueError(f"{curve.recipe}: no step of its run to compare with {reference.recipe}'s")
    relative = [abs(loss - ref) / abs(ref) for ref, loss in pairs]
    val = (abs(curve.val_loss - reference.val_loss) / abs(reference.val_loss)
           if curve.val_loss is not None and reference.val_loss is not None else None)
    return max(relative), relative[-1], val


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def table(curves: list[Curve]) -> list[str]:
    """The markdown table of each recipe against the first curve (bf16)."""
    reference = curves[0]
    rows = ["| recipe | steps | final loss | validation loss | max gap | final gap | validation gap | tokens/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for curve in curves:
        largest, last, val = gaps(reference, curve)
        name = "bf16 (none)" if curve.recipe == "none" else curve.recipe
        val_loss = "n/a" if curve.val_loss is None else f"{curve.val_loss:.4f}"
        speed = "n/a" if curve.tokens_per_sec is None else f"{curve.tokens_per_sec:,.0f}"
        rows.append(f"| {name} | {len(curve.losses)} | {curve.losses[-1]:.4f} | {val_loss} | {_percent(largest)} | "
                    f"{_percent(last)} | {_percent(val)} | {speed} |")
    return rows


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES),
                   help="none (bf16) first: the others are compared with the first")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true", help="train.compile=true")
    p.add_argument("--eval-iters", type=int, default=8, help="validation batches at the last step")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "fp8_convergence", help="the metrics files")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    from megalite.config_cli import parse_config  # the training stack takes seconds to import: after --help
    from megalite.training.pretrain import pretrain

    args.out.mkdir(parents=True, exist_ok=True)
    curves = []
    for recipe in args.recipes:
        metrics = args.out / f"{recipe}.jsonl"
        metrics.unlink(missing_ok=True)  # the metrics writer appends
        pretrain(parse_config(run_args(args.shape, recipe, args.steps, args.device, args.compile, args.precision,
                                       args.eval_iters, metrics, extra)))
        curves.append(read_curve(metrics, recipe))
        gc.collect()
    print(f"\nFP8 against {args.recipes[0]}: {args.shape}, {args.steps} steps, {args.precision}, {args.device}"
          f"{', compiled' if args.compile else ''}; gap = |loss - reference| / reference at the same step")
    print("\n".join(table(curves)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
