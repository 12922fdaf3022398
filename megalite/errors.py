"""Errors in what the user gave, and how a job reports them: once, as lines that name the file or field
and the fix, instead of a traceback on every rank.

`UserError` marks them. It is mixed into the built-in type a caller catches (`InvalidInput` is a
ValueError, `MissingInput` a FileNotFoundError), so code and tests that catch those keep working.
Anything else (a bug, a crash, a timed-out collective) keeps its traceback.

Under torchrun every rank usually meets the same error (each validates the same config, builds the
same tokenizer, reads the same checkpoint config). One rank prints it and exits with status 2; the
others exit 0 without a word, so that torchrun's failure block lists one rank, whose root cause is the
message itself (written to the error file torchrun reads) rather than a link to its documentation.
Who prints: before the process group exists, local rank 0 of each node (a node-local problem, such
as a missing file, is still reported where it happened); afterwards the first rank to claim the
message through the c10d store (training/pretrain.py), and any rank whose message differs.
No torch here: `pretrain_gpt.py --help` and the config layer import this module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error in a config field, a file, a dataset or a checkpoint; its message names it and the fix."""

    report_here: bool | None = None  # set by the rank that decides who reports (None: the default rule)


class InvalidInput(ValueError, UserError):
    """A value, file or dataset that cannot be used as given."""


class MissingInput(FileNotFoundError, UserError):
    """A file or directory the config names that does not exist."""


def _reports(error: UserError) -> bool:
    if error.report_here is not None:
        return error.report_here
    return os.environ.get("LOCAL_RANK", "0") == "0"


def report(error: UserError, program: str = "pretrain_gpt.py") -> int:
    """Print `error` if this rank is the one to (see the module doc) and return the exit status: 2 where it
    was printed, 0 on the ranks that stay silent (which then ignore torchrun's SIGTERM to the rest of the
    job: they are leaving anyway, and a rank killed by it would be listed as a second failure)."""
    if not _reports(error):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return 0
    message = f"{program}: error: {error}"
    print(message, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun shows this as the root cause of the failure
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    return EXIT_USER_ERROR
