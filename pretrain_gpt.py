"""Pretrain a GPT: `python pretrain_gpt.py --config FILE.yaml [--section.field=value ...]`,
or the same under `torchrun --nproc_per_node=N`. `--help` lists every field."""

import sys

from megalite.config import ConfigError
from megalite.config_cli import config_from_argv
from megalite.training.pretrain import pretrain


def main() -> int:
    try:
        cfg = config_from_argv()
        result = pretrain(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result.stopped_by and result.checkpoint is None:
        return 128 + result.stopped_by  # stopped by a signal with nothing saved: the shell's status for it
    return 0


if __name__ == "__main__":
    sys.exit(main())
