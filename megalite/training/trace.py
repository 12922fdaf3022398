"""Write the pipeline schedule as a Chrome trace (open in Perfetto or chrome://tracing).

One process row per rank, one box per forward (F) or backward (B) of a (chunk, micro batch) (a paired F&B's
two parts, DualPipeV's, one above the other: its backward on the rank's second row);
the picture shows the warm-up, the 1F1B steady state and the bubbles at a glance. Times are
the device's (CUDA events on a GPU, parallel/timing.py), placed on the host clock at the first
operation's enqueue time, so the rows of different ranks line up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from megalite.parallel.pipeline.executor import Trace
from megalite.parallel.topology import Topology


def write_chrome_trace(path: str, trace: Trace, topology: Topology, steps: int) -> None:
    """Collective: gathers every rank's events; global rank 0 writes the file."""
    t = topology
    mine = {"rank": t.rank, "pp": t.pp_rank, "tp": t.tp_rank, "dp": t.dp_rank, "events": trace.timed_events(),
            "peak_in_flight": trace.peak_in_flight}
    gathered = [None] * t.world_size
    dist.all_gather_object(gathered, mine)
    if t.rank != 0:
        return
    origin = min((e[3] for r in gathered for e in r["events"]), default=0.0)
    events = []
    for r in gathered:
        label = (f"rank {r['rank']} (pp {r['pp']}, tp {r['tp']}, dp {r['dp']}; "
                 f"peak stored activations {r['peak_in_flight']})")
        events.append({"name": "process_name", "ph": "M", "pid": r["rank"], "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r["rank"],
                       "args": {"sort_index": r["pp"] * 10000 + r["rank"]}})
        for kind, chunk, mb, start, end, paired in r["events"]:  # a pair's backward part on a row of its own
            events.append({"name": f"{kind} c{chunk} mb{mb}", "cat": kind, "ph": "X", "pid": r["rank"],
                           "tid": int(paired and kind != "F"), "ts": (start - origin) * 1e6,
                           "dur": (end - start) * 1e6, "args": {"chunk": chunk, "microbatch": mb, "paired": paired}})
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "otherData": {"steps": steps}}))
    os.replace(tmp, target)
