"""Sample continuations of prompts from a megalite checkpoint (saved at any layout), in one process.

Examples:
    python tools/generate.py --load runs/quickstart/checkpoints --prompt "ROMEO:" --max-new-tokens 40 --temperature 0
    python tools/generate.py --load ckpt --prompt "Once upon" --prompt "To be" --temperature 0.8 --top-k 50 --top-p 0.95
"""

from __future__ import annotations

import argparse
import sys

import torch

from megalite.inference.generate import Sampling, generate, load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True,
                        help="megalite checkpoint: its root (latest iteration) or an iter_* directory")
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to continue (repeat for several prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample among the most likely tokens holding this probability")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true",
                        help="re-run the whole sequence every step (slower; same tokens)")
    parser.add_argument("--ignore-eod", action="store_true", help="keep going past the end-of-document token")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        model, cfg, tokenizer = load_model(args.load, torch.device(args.device))
        if tokenizer is None:
            raise ValueError(f"{args.load}: its config names no tokenizer (data.tokenizer_type), "
                             "so prompts cannot be encoded")
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, not args.no_cache,
                            () if args.ignore_eod else (tokenizer.eod,))
        for prompt in args.prompt:
            new = generate(model, tokenizer.encode(prompt), sampling)
            print(f"{prompt}{tokenizer.decode(new)}\n" + "-" * 40)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
