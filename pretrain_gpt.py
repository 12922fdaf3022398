"""Pretrain a GPT: `python pretrain_gpt.py --config FILE.yaml [--section.field=value ...]`,
or the same under `torchrun --nproc_per_node=N`. `--help` lists every field.
`pretrain_gpt.py --check --nproc-per-node=N [--nnodes=M] ARGS` checks that launch without starting it.

An error in the config or in a file it names is printed once for the job, as lines naming the field or
file and the fix, and the job exits with status 2 (megalite/errors.py)."""

import sys

from megalite.config_cli import config_from_argv
from megalite.errors import UserError, report
from megalite.launch_flags import split_launch_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        launch, args = split_launch_args(argv)
        cfg = config_from_argv(args)  # --help answers here, before torch is imported
        if launch is not None:
            from megalite.training.launch_check import check_launch

            print("\n".join(["pretrain_gpt.py --check: this launch is valid", *check_launch(cfg, *launch, args)]))
            return 0
        from megalite.training.pretrain import pretrain

        result = pretrain(cfg)
    except UserError as err:
        return report(err)
    if result.stopped_by and result.checkpoint is None:
        return 128 + result.stopped_by  # stopped by a signal with nothing saved: the shell's status for it
    return 0


if __name__ == "__main__":
    sys.exit(main())
