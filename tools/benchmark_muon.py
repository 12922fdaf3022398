"""Muon against AdamW on the same small model, data and settings: validation loss and tokens/s of each.

Both runs pretrain one model (`--family`, `--layers` x `--hidden`) from the same initialisation on the
Shakespeare plays in assets/ (GPT-2 BPE; Hamlet held out for validation), with the same learning rate schedule,
weight decay, clipping and batches; only `optim.optimizer` differs (Muon's `rms` scale carries AdamW's learning
rate over). Printed: each optimizer's validation loss at the end, its last training loss and its tokens/s over
the run (pretrain's own figure), in one process.

    python tools/benchmark_muon.py                                   # llama, 4 x 128, 300 steps, on the CPU
    python tools/benchmark_muon.py --steps 1000 --device cuda --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from megalite.config_cli import parse_config
from megalite.data.indexed_dataset import IndexedDatasetWriter, optimal_dtype
from megalite.data.tokenizers import build_tokenizer
from megalite.training.pretrain import pretrain

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TRAIN = ("macbeth_gut.txt", "lear_gut.txt", "othello_gut.txt", "tempest_gut.txt", "julius_caesar_gut.txt")
VALID = ("hamlet_gut.txt",)
TOKENIZER = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(ASSETS / "gpt2/vocab.json"),
             "merge_file": str(ASSETS / "gpt2/merges.txt")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    return p.parse_args(argv)


def write_corpus(plays: tuple[str, ...], prefix: Path) -> str:
    tok = build_tokenizer(**TOKENIZER)
    with IndexedDatasetWriter(str(prefix), optimal_dtype(tok.vocab_size)) as writer:
        for play in plays:
            writer.add_document(np.array(tok.encode((ASSETS / "shakespeare" / play).read_text()) + [tok.eod]))
    return str(prefix)


def run(args: argparse.Namespace, optimizer: str, root: Path, train: str, valid: str) -> dict[str, float]:
    """One pretraining run; its final validation loss, last training loss and tokens/s."""
    metrics = root / f"{optimizer}.jsonl"
    cfg = parse_config([
        f"--model.family={args.family}", f"--model.num_layers={args.layers}", f"--model.hidden_size={args.hidden}",
        f"--model.num_attention_heads={args.heads}", f"--model.seq_length={args.seq}", "--train.micro_batch_size=4",
        f"--train.global_batch_size={args.batch}", f"--train.train_iters={args.steps}", f"--train.device={args.device}",
        f"--train.precision={args.precision}", f"--train.eval_interval={args.steps}", "--train.eval_iters=8",
        f"--optim.optimizer={optimizer}", f"--optim.lr={args.lr}", f"--optim.min_lr={args.lr / 10}",
        f"--optim.warmup_iters={args.steps // 20}", f"--data.train_paths={train}", f"--data.valid_paths={valid}",
        *(f"--data.{k}={v}" for k, v in TOKENIZER.items()), f"--data.cache_dir={root / 'cache'}",
        "--data.num_workers=0", f"--logging.metrics_file={metrics}", f"--logging.log_interval={args.steps // 10}",
        "--logging.progress_bar=false"])
    result = pretrain(cfg)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    speeds = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]  # the first includes start-up
    return {"val_loss": result.val_loss, "loss": result.losses[max(result.losses)],
            "tokens_per_sec": sum(speeds) / len(speeds)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train, valid = write_corpus(TRAIN, root / "train"), write_corpus(VALID, root / "valid")
        results = {name: run(args, name, root, train, valid) for name in ("adamw", "muon")}
    print(f"{args.family} {args.layers} x {args.hidden}, seq {args.seq}, batch {args.batch}, {args.steps} steps, "
          f"lr {args.lr}, {args.precision} on {args.device}")
    print(f"{'optimizer':<10}{'val loss':>10}{'train loss':>12}{'tokens/s':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['val_loss']:>10.3f}{r['loss']:>12.3f}{r['tokens_per_sec']:>12,.0f}")


if __name__ == "__main__":
    main()
