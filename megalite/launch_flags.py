"""The flags `pretrain_gpt.py --check --nproc-per-node N [--nnodes M]` adds to a config's arguments, split off
before the config is parsed. No torch here: `pretrain_gpt.py --help` imports this module."""

from __future__ import annotations

from megalite.config import ConfigError

LAUNCH_FLAGS = ("--check", "--nproc-per-node", "--nnodes")


def split_launch_args(argv: list[str]) -> tuple[tuple[int, int] | None, list[str]]:
    """((processes per node, nodes) when --check is given, else None), and the config's arguments."""
    values, rest, i = {}, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        name = name.replace("_", "-") if name.startswith("--n") else name
        if name not in LAUNCH_FLAGS:
            rest.append(argv[i])
        elif name == "--check":
            values[name] = "1"
        else:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value: {name}=N")
                value, i = argv[i + 1], i + 1
            values[name] = value
        i += 1
    if "--check" not in values:
        if len(values):
            raise ConfigError(f"{', '.join(values)} go with --check (a launch's size comes from torchrun)")
        return None, rest
    try:
        nproc, nnodes = int(values.get("--nproc-per-node", "1")), int(values.get("--nnodes", "1"))
    except ValueError:
        raise ConfigError("--nproc-per-node and --nnodes take whole numbers") from None
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"--nproc-per-node={nproc} and --nnodes={nnodes} must be >= 1")
    return (nproc, nnodes), rest
