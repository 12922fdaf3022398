"""Dry-run a layout at its full size on one CPU: the real model, buffers, optimizer and pipeline of one rank
of each role, built and stepped on fake tensors under torch's fake process group.

    python tools/dry_run.py --config examples/llama_70b.yaml --world-size 64
    python tools/dry_run.py --config examples/llama_405b.yaml --world-size 16384 --microbatches all
    python tools/dry_run.py --config my.yaml --world-size 1024 --gpu h200 --parallel.pp=8

For the first, a middle and the last pipeline stage it prints the memory alive at the step's peak by kind
(parameters, gradients, main weights, optimizer state, saved activations, the rest) beside the planner's,
every collective and point-to-point call of the step with its bytes, and a verdict for the GPU; then the whole
pipeline's messages replayed under NCCL's rules at the full pp x vp, and the time and memory of building one
rank's groups at that world size. By default (`--microbatches peak`) it simulates the fewest micro batches whose
schedule reaches the same memory peak (a minute for the 405B example); `--microbatches all` runs the config's
whole step (its every micro batch: much longer for a large global batch).
Exit status: 0 when every simulated rank runs its step and fits and the pipeline passes, 1 otherwise, 2 for a
config that is invalid or that the dry run cannot simulate. How it works: megalite/dryrun/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script Python puts tools/ first, not the root

from megalite.config import ConfigError  # noqa: E402
from megalite.config_cli import apply_mapping, parse_config  # noqa: E402
from megalite.dryrun.report import exit_status, format_dry_run  # noqa: E402
from megalite.dryrun.run import dry_run  # noqa: E402
from megalite.planning.measure import MEASUREMENT  # noqa: E402
from megalite.planning.plan import GPUS  # noqa: E402


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, as pretrain_gpt.py takes")
    p.add_argument("--world-size", type=int, required=True, help="number of GPUs (processes) of the run")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="device type whose memory the verdict uses")
    p.add_argument("--microbatches", default="peak",
                   help="micro batches per step to simulate: peak (default: the fewest with the same memory peak), "
                        "all (the config's) or a number")
    p.add_argument("--explain", type=int, default=0, metavar="N",
                   help="list the N largest tensors alive at each rank's peak and the line of megalite that made each")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = parse_config(["--config", args.config, *overrides])
        apply_mapping(cfg, MEASUREMENT, "the dry run's settings")  # mock data, no checkpoints, CPU
        count = args.microbatches if args.microbatches in ("all", "peak") else int(args.microbatches)
        report = dry_run(cfg, args.world_size, count, args.explain)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_dry_run(report, args.gpu))
    return exit_status(report, args.gpu)


if __name__ == "__main__":
    sys.exit(main())
