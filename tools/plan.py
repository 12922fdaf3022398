"""Will this layout fit, and how fast will it go? Or: which layout is fastest? Answers from the config alone.

    python tools/plan.py --config examples/llama_8b.yaml --world-size 16 --gpu h100
    python tools/plan.py --config my.yaml --world-size 64 --gpu a100 --assumed-mfu 0.35 --parallel.pp=4
    python tools/plan.py --config examples/llama_70b.yaml --nodes 8 --gpus-per-node 8 --search
    python tools/plan.py --hf-config path/to/config.json --nodes 8 --search --model.seq_length=8192 \
        --train.global_batch_size=512
    python tools/plan.py --config examples/llama_70b.yaml --world-size 64 --explain

Prints parameters (total and per GPU of each pipeline stage), memory per GPU of the stage that
needs most (weights, gradients, fp32 main weights, optimizer state, activations of the micro
batches the schedule keeps in flight; with train.fp8_recipe an FP8 line: the recipe, its layers and the
activations its kept FP8 inputs save), under context parallelism the bytes its attention sends
per rank, the pipeline bubble (the schedule's op lists played out at F = B = W, which the pipeline benchmark
measures, and its formula beside it), with pp > 1 every schedule the layout allows (1F1B, GPipe, ZB-H1, ZB-V
and DualPipeV at vp 2) with its bubble, activations and verdict, FLOPs per step and the step time at an
assumed MFU, then (when it does not fit) the cheapest single changes that would make it fit, and last the verdict:
"fits: X GiB of Y GiB" or "does not fit: X GiB needed, Y GiB available".

--search keeps the model and the global batch and tries every tp, cp, pp, vp, schedule, ep, etp, ZeRO stage,
recompute and micro batch size the validator accepts, and prints the five fastest that fit with each one's step time by
cause and why the first wins. --explain prints the time model's terms for the config's own layout. The time
model (megalite/planning/step_time.py): compute at --assumed-mfu of the GPU's dense peak over the hardware FLOPs
(recompute included), the schedule's bubble, and each axis's traffic on the link its groups cross (NVLink inside a
node, the network between nodes: --nvlink-gbs, --network-gbits; defaults per GPU in megalite/planning/cluster.py),
hidden where megalite overlaps it.
Exit status: 0 when it fits (or a layout was found), 1 when not, 2 for an invalid config. Extra
`--section.field=value` arguments override the config as in pretrain_gpt.py (with --hf-config, model fields in
the `--model.field=value` form). With --hf-config the run is planned in bf16 (train.precision=bf16, the precision
the released models train in; megalite's own default, fp32, would time compute at the fp32 peak, ~15x slower):
pass --train.precision=fp32 to plan fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script Python puts tools/ first, not the root

from megalite.config import ConfigError  # noqa: E402
from megalite.config_cli import parse_config, set_field  # noqa: E402
from megalite.config_validation import validate  # noqa: E402
from megalite.planning.cluster import Cluster  # noqa: E402
from megalite.planning.plan import GPUS, format_plan, make_plan  # noqa: E402
from megalite.planning.search import with_data  # noqa: E402


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config, as pretrain_gpt.py takes")
    p.add_argument("--hf-config", help="a Hugging Face config.json (or its directory) for the model instead")
    p.add_argument("--world-size", type=int, help="number of GPUs (processes) of the run")
    p.add_argument("--nodes", type=int, help="nodes of the run (world size = nodes x --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8): NVLink's reach")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="device type: its memory and peak TFLOP/s")
    p.add_argument("--assumed-mfu", type=float, default=0.4,
                   help="share of the dense peak a GPU reaches on the model's FLOPs (default 0.4, below the 0.465 "
                        "tools/gpu_check.py measured for eager training of GPT-2 1.3B and Llama-3.2-1B on one H100, "
                        "0.539 compiled: docs/benchmarks.md; pass 0.465 for the measured figure)")
    p.add_argument("--nvlink-gbs", type=float, help="NVLink GB/s per GPU, both ways (default: the GPU's, 900 on H100)")
    p.add_argument("--network-gbits", type=float, help="network Gb/s per GPU (default: 400, InfiniBand NDR; A100 200)")
    p.add_argument("--search", action="store_true", help="find the fastest layouts that fit")
    p.add_argument("--explain", action="store_true", help="the time model's terms for the config's layout")
    return p.parse_known_args(argv)


def load_config(args: argparse.Namespace, overrides: list[str]):
    """The config of --config (YAML) or --hf-config (the HF model mapped as the converter maps it) with overrides."""
    if bool(args.config) == bool(args.hf_config):
        raise ConfigError("give one of --config (megalite YAML) and --hf-config (a Hugging Face config.json)")
    if args.config:
        return parse_config(["--config", args.config, *overrides])
    from transformers import AutoConfig

    from megalite.checkpoint.hf_config_read import model_config_from_hf
    from megalite.checkpoint.hf_deepseek import kimi_k2_config

    path = Path(args.hf_config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--hf-config {path}: no such file; give a Hugging Face config.json")
    data = json.loads(path.read_text())
    if data.get("model_type") == "kimi_k2":  # transformers knows it only through remote code
        hf = kimi_k2_config(data)
    else:
        hf = AutoConfig.for_model(data.pop("model_type"), **data)
    cfg = parse_config(["--train.precision=bf16", *(arg for arg in overrides if not arg.startswith("--model."))])
    try:
        cfg.model = model_config_from_hf(hf, str(path))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    for arg in (a for a in overrides if a.startswith("--model.")):
        key, _, value = arg[2:].partition("=")
        set_field(cfg, key, value, "command line")
    return cfg


def cluster_of(args: argparse.Namespace) -> Cluster:
    if args.nodes:
        nodes, per_node = args.nodes, args.gpus_per_node
    elif args.world_size:
        nodes, per_node = max(1, args.world_size // args.gpus_per_node), min(args.world_size, args.gpus_per_node)
        if nodes * per_node != args.world_size:
            raise ConfigError(f"--world-size {args.world_size} is not a multiple of --gpus-per-node {per_node}")
    else:
        raise ConfigError("give --world-size N or --nodes N (with --gpus-per-node, default 8)")
    return Cluster(nodes, per_node, args.gpu, args.nvlink_gbs, args.network_gbits)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = with_data(load_config(args, overrides))
        if not args.search and (args.world_size or args.nodes):  # the config's own errors first: they name its fix
            validate(cfg, args.world_size or args.nodes * args.gpus_per_node)
        cluster = cluster_of(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from megalite.planning.search import search
    from megalite.planning.search_report import format_explain, format_fixes, format_search

    if args.search:
        try:
            result = search(cfg, cluster, args.assumed_mfu)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(format_search(result, cluster, args.assumed_mfu))
        return 0 if result.ranked else 1
    if args.explain:
        print(format_explain(cfg, cluster, args.assumed_mfu))
        return 0
    plan = make_plan(cfg, cluster.world_size, args.gpu, args.assumed_mfu)
    report, verdict = format_plan(plan).rsplit("\n", 1)
    fixes = [] if plan.fits else [format_fixes(cfg, cluster, args.assumed_mfu)]
    print("\n".join([report, *fixes, verdict]))  # the verdict stays the last line: scripts read it
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
