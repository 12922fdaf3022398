"""Convert checkpoints: megalite <-> Hugging Face (GPT-2, Llama, Mistral, Mixtral, Qwen2/3(-MoE), gpt-oss), Megatron-LM.

--to-hf reads a megalite checkpoint saved at any parallel layout (its root, which means its
latest iteration, or one iter_* directory) and writes a Hugging Face model directory: config.json,
sharded model.safetensors with its index, generation_config.json and the tokenizer the run was
trained with; multi-token prediction layers as DeepSeek-V3's hub layers after the main ones (other
architectures have none: --drop-mtp leaves them out).
--from-hf reads a Hugging Face model directory (or a .gguf file; gpt-oss's MXFP4 experts are dequantised as
they come in; DeepSeek-V3's MTP layers become model.mtp_num_layers depths) and writes a weights-only megalite
checkpoint that pretrain_gpt.py resumes
at any tp/pp/vp/dp, with the model config derived from config.json saved in its config.yaml. Which
architectures map, and what is refused because one side does not compute it, is
megalite/checkpoint/hf_config.py's to say.
--from-megatron reads a Megatron-LM checkpoint (legacy `torch` or `torch_dist` format, any tensor/pipeline
parallel size; its root or one iteration directory) without Megatron installed and writes a megalite checkpoint
that continues the run: weights, Adam's state and step, the iteration and consumed samples, and the config from
Megatron's args, its data settings included, so that the run trains on Megatron's next samples; it prints
what it carried and what to check (Megatron's paths) (megalite/checkpoint/megatron/).

Examples:
    python tools/convert_checkpoint.py --to-hf --load runs/quickstart/checkpoints --save runs/quickstart/hf
    python tools/convert_checkpoint.py --from-hf --load path/to/hf_model --save checkpoints/from_hf
    python tools/convert_checkpoint.py --from-megatron --load megatron/checkpoints --save checkpoints/from_megatron
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megalite.checkpoint.hf_convert import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.megatron.convert import megatron_to_megalite


def _continue_with(iteration: Path, root: str, flags: list[str]) -> None:
    print(f"continue pretraining with pretrain_gpt.py --config {iteration / 'config.yaml'} --checkpoint.load={root}",
          *flags)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-hf", action="store_true", help="megalite checkpoint -> Hugging Face directory")
    direction.add_argument("--from-hf", action="store_true",
                           help="Hugging Face directory or .gguf file -> megalite checkpoint")
    direction.add_argument("--from-megatron", action="store_true",
                           help="Megatron-LM checkpoint (legacy torch or torch_dist) -> megalite checkpoint")
    parser.add_argument("--load", required=True, help="what to convert")
    parser.add_argument("--save", required=True, help="the output directory (must not exist or be empty)")
    parser.add_argument("--max-shard-size", default="2GB", help="--to-hf: largest safetensors shard (default 2GB)")
    parser.add_argument("--drop-mtp", action="store_true",
                        help="--to-hf: write the main model without its multi-token prediction weights (needed for "
                             "architectures other than DeepseekV3, which alone stores them)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="--from-hf: pad the vocabulary to a multiple of this "
                             "(it must be divisible by the tp you train at)")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="--from-megatron: carry the weights only (Adam's state starts afresh)")
    args = parser.parse_args(argv)
    try:
        if args.to_hf:
            out = megalite_to_hf(args.load, args.save, args.max_shard_size, args.drop_mtp)
            print(f"wrote Hugging Face model {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
        elif args.from_megatron:
            converted = megatron_to_megalite(args.load, args.save, not args.no_optimizer)
            print(f"wrote megalite checkpoint {converted.path}", *converted.report, sep="\n")
            _continue_with(converted.path, args.save, converted.flags)
        else:
            out = hf_to_megalite(args.load, args.save, args.make_vocab_size_divisible_by)
            print(f"wrote megalite checkpoint {out}")
            _continue_with(out, args.save, ["--data.paths=..."])
    except (FileNotFoundError, FileExistsError, ValueError) as error:  # the user's to fix: the message, not a traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
