"""Pretrain a GPT: `python pretrain_gpt.py --config FILE.yaml [--section.field=value ...]`,
or the same under `torchrun --nproc_per_node=N`. `--help` lists every field."""

import sys

from megalite.config import ConfigError
from megalite.config_cli import config_from_argv


def main() -> int:
    try:
        cfg = config_from_argv()  # --help answers here, before torch is imported
        from megalite.training.pretrain import pretrain

        pretrain(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
