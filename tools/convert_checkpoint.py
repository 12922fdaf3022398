"""Convert checkpoints between megalite and Hugging Face transformers (GPT-2, Llama, Mixtral, Qwen3, Qwen3-MoE).

--to-hf reads a megalite checkpoint saved at any parallel layout (its root, which means its
latest iteration, or one iter_* directory) and writes a Hugging Face model directory: config.json,
sharded model.safetensors with its index, generation_config.json and the tokenizer the run was
trained with. --from-hf reads a Hugging Face model directory (or a .gguf file) and writes a
weights-only megalite checkpoint that pretrain_gpt.py resumes at any tp/pp/vp/dp, with the
model config derived from config.json saved in its config.yaml. Which architectures map, and what is
refused because one side does not compute it, is megalite/checkpoint/hf_config.py's to say.

Examples:
    python tools/convert_checkpoint.py --to-hf --load runs/quickstart/checkpoints --save runs/quickstart/hf
    python tools/convert_checkpoint.py --from-hf --load path/to/hf_model --save checkpoints/from_hf
"""

from __future__ import annotations

import argparse
import sys

from megalite.checkpoint.hf_convert import hf_to_megalite, megalite_to_hf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-hf", action="store_true", help="megalite checkpoint -> Hugging Face directory")
    direction.add_argument("--from-hf", action="store_true",
                           help="Hugging Face directory or .gguf file -> megalite checkpoint")
    parser.add_argument("--load", required=True, help="what to convert")
    parser.add_argument("--save", required=True, help="the output directory (must not exist or be empty)")
    parser.add_argument("--max-shard-size", default="2GB", help="--to-hf: largest safetensors shard (default 2GB)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="--from-hf: pad the vocabulary to a multiple of this "
                             "(it must be divisible by the tp you train at)")
    args = parser.parse_args(argv)
    try:
        if args.to_hf:
            out = megalite_to_hf(args.load, args.save, args.max_shard_size)
            print(f"wrote Hugging Face model {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
        else:
            out = hf_to_megalite(args.load, args.save, args.make_vocab_size_divisible_by)
            print(f"wrote megalite checkpoint {out}; continue pretraining with "
                  f"pretrain_gpt.py --config {out / 'config.yaml'} --checkpoint.load={args.save} --data.paths=...")
    except (FileNotFoundError, FileExistsError, ValueError) as error:  # the user's to fix: the message, not a traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
