"""Which rank prints an error in what the user gave, once the process group exists (errors.py says why one).

The ranks of a job usually meet the same error at the same place, but not always (a file missing on one
node, a sample only one rank reads), so the rank to print is the first to claim the message through the
c10d store, which needs no collective: no rank waits for another that may never fail. A rank whose message
differs from the claimed one prints its own too.
"""

from __future__ import annotations

import secrets

import torch.distributed as dist

from megalite.errors import UserError


class ReportOnce:
    """Claims of this run's user errors, under a key the ranks agree on at start-up (a store outlives a run:
    several runs in one process group, torchrun's restarts)."""

    def __init__(self) -> None:
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=0)
        self.key = f"megalite/user_error/{token[0]}"

    def claim(self, error: UserError) -> None:
        """Set `error.report_here`: whether this rank is the one to print it."""
        mine = str(error)
        try:
            store = dist.distributed_c10d._get_default_store()
            first = store.add(f"{self.key}/count", 1) == 1
            if first:
                store.set(self.key, mine)
            error.report_here = first or store.get(self.key).decode() != mine
        except Exception:  # noqa: BLE001 - the store left with its host: print rather than lose the message
            error.report_here = True
