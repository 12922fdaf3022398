"""A collective that timed out, told as megalite's message: this rank, the group, the fix.

gloo raises a timeout in the thread that waits ("Timed out waiting 12000ms for recv ..."); the
group is then a local of the torch.distributed function on the stack. On NCCL the watchdog
aborts the hung communicators (topology.py sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so it does not
kill the process first) and the next call on them raises an error carrying the watchdog's
reason, which names the group by its description: "[PG ID 2 PG GUID 3(data-parallel) Rank 5]
Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, ...)".
"""

from __future__ import annotations

import re
from types import TracebackType

import torch.distributed as dist

_TIMEOUT = re.compile(r"timed out|timeout|communicator was aborted", re.IGNORECASE)
_NCCL_GROUP = re.compile(r"PG GUID \d+\(([^)]*)\)")
_DEFAULT = "default_pg"


def _group_on_stack(tb: TracebackType | None) -> dist.ProcessGroup | None:
    """The process group a torch.distributed function on the traceback was called with (None: the world)."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and "group" in frame.f_locals:
            group = frame.f_locals["group"]
            found = group if isinstance(group, dist.ProcessGroup) else dist.distributed_c10d._get_default_group()
        tb = tb.tb_next
    return found


def _describe(name: str, group: dist.ProcessGroup | None) -> str:
    if name == _DEFAULT:
        return "in the world group "
    ranks = f" (ranks {dist.get_process_group_ranks(group)})" if group is not None else ""
    return f"in the {name} group{ranks} "


def collective_timeout_message(error: BaseException, rank: int, minutes: float,
                               groups: dict[str, dist.ProcessGroup | None]) -> str | None:
    """megalite's message for a collective timeout (None if `error` is something else); `groups` maps
    the descriptions of this rank's groups to the groups, to list their ranks."""
    if not isinstance(error, RuntimeError) or not _TIMEOUT.search(str(error)):
        return None
    named = _NCCL_GROUP.search(str(error))
    if named:
        where = _describe(named.group(1), groups.get(named.group(1)))
    else:
        group = _group_on_stack(error.__traceback__)
        where = _describe(group.group_desc, group) if group is not None else ""
    return (f"rank {rank}: a collective timed out after parallel.timeout_minutes={minutes}; another rank died or hangs "
            f"{where}(check its log), or steps are slower than that: then raise the timeout")
