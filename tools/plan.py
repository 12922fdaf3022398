"""Will this layout fit, and how fast will it go? Answers from the config alone, before queueing.

    python tools/plan.py --config examples/llama_8b.yaml --world-size 16 --gpu h100
    python tools/plan.py --config my.yaml --world-size 64 --gpu a100 --assumed-mfu 0.35 --parallel.pp=4

Prints parameters (total and per GPU of each pipeline stage), memory per GPU of the stage that
needs most (weights, gradients, fp32 main weights, optimizer state, activations of the micro
batches the schedule keeps in flight), under context parallelism the bytes its attention sends
per rank, the pipeline bubble (the schedule's op lists played out at F = B = W, which the pipeline benchmark
measures, and its formula beside it), with pp > 1 every schedule the layout allows (1F1B, GPipe, ZB-H1, ZB-V
and DualPipeV at vp 2) with its bubble, activations and verdict, FLOPs per step and the step time at an
assumed MFU, then
"fits: X GiB of Y GiB" or "does not fit: X GiB needed, Y GiB available".
Exit status: 0 when it fits, 1 when it does not, 2 for an invalid config. Extra `--section.field=value`
arguments override the config as in pretrain_gpt.py. How the figures are computed:
megalite/planning/.
"""

from __future__ import annotations

import argparse
import sys

from megalite.config import ConfigError
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.planning.plan import GPUS, format_plan, make_plan


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, as pretrain_gpt.py takes")
    p.add_argument("--world-size", type=int, required=True, help="number of GPUs (processes) of the run")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="device type: its memory and peak TFLOP/s")
    p.add_argument("--assumed-mfu", type=float, default=0.4, help="model FLOPs utilisation to expect (0-1)")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = parse_config(["--config", args.config, *overrides])
        validate(cfg, args.world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plan = make_plan(cfg, args.world_size, args.gpu, args.assumed_mfu)
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
