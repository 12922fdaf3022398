"""A chrome trace of one profiled step (benchmark_throughput.py --profile-trace) read back on any machine: the same
summary as tools/profile_summary.py gives on the GPU (so a fix to its arithmetic or its kernel families applies to
traces already taken), and each kernel's time charged to the op that launched it.

    python tools/profile_trace.py trace_gpt2_megalite.json.gz [--top 40]

Which op launched a kernel: the kernel's correlation id names its launch (cudaLaunchKernel and kin) on the host,
and the ops open around that launch on its thread are the op's stack. A kernel is charged to the outermost autograd
node of that stack in backward (`SelectBackward0`, `NativeLayerNormBackward0`), else to the outermost aten op
(`aten::layer_norm`), beside the innermost aten op that ran it (`aten::fill_`, `aten::copy_`): what a fusion or
another formulation of that op would save. Kernels launched outside every op (the autograd engine adding two
gradients of one tensor) are charged to the innermost op there is, as the trace shows them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.profile_summary import Record, family, summarize  # noqa: E402

DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")  # not gpu_user_annotation: a range over kernels
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")


def load(path: Path) -> list[dict]:
    """The trace's events (a .json or .json.gz file as torch.profiler's export_chrome_trace writes it)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _by_thread(events: list[dict]) -> dict[object, list[dict]]:
    threads = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and e.get("ph") == "X":
            threads[e["tid"]].append(e)
    for items in threads.values():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))  # an enclosing event before what it encloses
    return threads


def _stacks(events: list[dict]) -> tuple[dict[int, float], dict[int, list[str]]]:
    """(each host event's self time in us by its index in `events`, the names of the cpu ops open around each
    launch by its correlation id, outermost first)."""
    index = {id(e): i for i, e in enumerate(events)}
    self_us, open_ops = {}, {}
    for items in _by_thread(events).values():
        stack: list[dict] = []
        for e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_us[index[id(stack[-1])]] -= e["dur"]
            self_us[index[id(e)]] = e["dur"]
            if e["cat"] != "cpu_op":
                open_ops[e.get("args", {}).get("correlation")] = [o["name"] for o in stack if o["cat"] == "cpu_op"]
            stack.append(e)
    return self_us, open_ops


def records_of_trace(events: list[dict]) -> list[Record]:
    """profile_summary's records from a trace: kernels, memsets and copies on the device; ops, runtime and driver
    calls on the host, each with its self time."""
    self_us, _ = _stacks(events)
    records = []
    for i, e in enumerate(events):
        if e.get("cat") in DEVICE_CATEGORIES:
            records.append(Record(e["name"], True, e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") in HOST_CATEGORIES and e.get("ph") == "X":
            records.append(Record(e["name"], False, e["ts"], e["ts"] + e["dur"], self_us[i]))
    return records


def _charged_to(names: list[str]) -> tuple[str, str]:
    """(the autograd node or outermost aten op, the innermost aten op) of a launch's open ops."""
    aten = [n for n in names if n.startswith("aten::")]
    nodes = [n for n in names if not n.startswith(("aten::", "autograd::"))]
    inner = aten[-1] if aten else (names[-1] if names else "no op")
    return (nodes[0] if nodes else aten[0] if aten else inner), inner


def time_by_op(events: list[dict], top: int = 40) -> list[dict]:
    """Kernel time by (launching node or op, innermost aten op, kernel family), the costliest first."""
    _, open_ops = _stacks(events)
    time, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            key = (*_charged_to(open_ops.get(e.get("args", {}).get("correlation"), [])), family(e["name"]))
            time[key] += e["dur"]
            count[key] += 1
    ranked = sorted(time.items(), key=lambda item: -item[1])[:top]
    return [{"op": op, "inner": inner, "family": fam, "ms": us / 1e3, "kernels": count[op, inner, fam]}
            for (op, inner, fam), us in ranked]


def markdown(events: list[dict], top: int) -> list[str]:
    summary = summarize(records_of_trace(events))
    d = summary["device"]
    lines = [f"device span {d['span_ms']:.1f} ms, busy {d['busy_ms']:.1f} ms, {d['kernels']} kernels", "",
             "| kernel family | ms | share | kernels |", "|---|---:|---:|---:|",
             *(f"| {f['family']} | {f['ms']:.2f} | {f['share']:.1%} | {f['kernels']} |" for f in summary["families"]),
             "", "| launched by | aten op | family | ms | kernels |", "|---|---|---|---:|---:|"]
    return lines + [f"| `{r['op']}` | `{r['inner']}` | {r['family']} | {r['ms']:.2f} | {r['kernels']} |"
                    for r in time_by_op(events, top)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a chrome trace (.json or .json.gz) of one step")
    p.add_argument("--top", type=int, default=40, help="rows of the launched-by table")
    args = p.parse_args(argv)
    print("\n".join(markdown(load(args.trace), args.top)))


if __name__ == "__main__":
    main()
