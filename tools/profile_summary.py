"""Where one training step spends its time, as data: tools/benchmark_throughput.py --profile-json writes this for
each side it profiles, and tools/gpu_check.py's profile step turns it into the report's tables.

From torch.profiler's events of one step (kernels on the device, runtime calls and aten ops on the host):
  device    the span from the first kernel's start to the last one's end, the time some kernel ran in it (busy),
            the rest (idle: launch gaps, host work the device waited for), the gaps between kernels by size, and
            the kernels shorter than 10 us (where launch cost, not the work, sets the pace)
  families  kernel time by family (matmuls, attention, norms, softmax / cross-entropy, optimizer, copies and
            casts, elementwise, reductions, triton), each with its share of the busy time: what a fusion can win
  kernels   the costliest kernels by total time
  host      the ops with the most self time on the host, kernel launches, and host syncs (stream / device
            synchronizations, device-to-host copies, .item() / nonzero): each stalls the host until the device
            catches up, so the launch queue drains
  sync_sites  where the syncs come from: the innermost frame in megalite or tools/ of each sync op's Python stack
            (from a second profiled step recorded with stacks, so that stack recording does not slow the first)
The records are plain (name, on the device or not, start and end in microseconds), so the arithmetic is tested
on a CPU with made-up records; a CPU profile simply has no device records.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass

KERNEL_FAMILIES = (  # (family, pattern on a kernel's name), the first that matches names its family
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),  # cuDNN's SDPA has helper kernels (cudnn::fusion::...)
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|splitk|sm90_|sm80_"),
    ("norm", r"layer_?norm|rms_?norm|gammabeta"),  # LayerNorm's weight and bias gradients: GammaBetaBackward
    ("softmax / cross-entropy", r"softmax|nll_loss|cross_entropy"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|lamb(?!da)|muon"),  # lamb, not the {lambda()#3} of any functor
    ("copy / cast", r"memcpy|memset|copy|catarray|transpose|index_put|gather|scatter"),  # casts are copy kernels;
    # `cast` would match every functor run through gpu_kernel_impl_nocast or LoadWithCast
    ("reduction", r"reduce"),
    ("triton", r"^triton_"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
GAP_EDGES_US = (10, 100, 1000)
SHORT_KERNEL_US = 10
TOP = 25


@dataclass(frozen=True)
class Record:
    name: str
    on_device: bool
    start_us: float
    end_us: float
    self_us: float | None = None  # a host op's own time (without its children); None: its whole duration

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((f for f, pattern in KERNEL_FAMILIES if re.search(pattern, name)), "other")


def busy_intervals(kernels: list[Record]) -> list[tuple[float, float]]:
    """The union of the kernels' intervals, merged and sorted (kernels on several streams overlap)."""
    merged: list[list[float]] = []
    for k in sorted(kernels, key=lambda r: r.start_us):
        if merged and k.start_us <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], k.end_us)
        else:
            merged.append([k.start_us, k.end_us])
    return [(a, b) for a, b in merged]


def device_summary(kernels: list[Record]) -> dict:
    if not kernels:
        return {"kernels": 0}
    busy = busy_intervals(kernels)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    short = [k.us for k in kernels if k.us < SHORT_KERNEL_US]
    return {"kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": busy_us / 1e3, "idle_ms": (span - busy_us) / 1e3,
            "idle_share": (span - busy_us) / span if span else 0.0,
            "gaps": {f"over_{edge}us": {"count": sum(g > edge for g in gaps),
                                        "ms": sum(g for g in gaps if g > edge) / 1e3} for edge in GAP_EDGES_US},
            f"kernels_under_{SHORT_KERNEL_US}us": {"count": len(short), "ms": sum(short) / 1e3}}


def family_table(kernels: list[Record]) -> list[dict]:
    total = sum(k.us for k in kernels) or 1.0
    time, count = defaultdict(float), Counter()
    for k in kernels:
        time[family(k.name)] += k.us
        count[family(k.name)] += 1
    return [{"family": f, "ms": us / 1e3, "share": us / total, "kernels": count[f]}
            for f, us in sorted(time.items(), key=lambda item: -item[1])]


def top_by_name(records: list[Record], self_time: bool = False, top: int = TOP) -> list[dict]:
    time, count = defaultdict(float), Counter()
    for r in records:
        time[r.name] += r.self_us if self_time and r.self_us is not None else r.us
        count[r.name] += 1
    ranked = sorted(time.items(), key=lambda item: -item[1])[:top]
    return [{"name": name[:160], "ms": us / 1e3, "count": count[name]} for name, us in ranked]


def summarize(records: list[Record], sync_sites: list[dict] | None = None) -> dict:
    """The step's summary (see the module docstring) from its records."""
    kernels = [r for r in records if r.on_device]
    host = [r for r in records if not r.on_device]
    launches = [r for r in host if r.name in LAUNCHES]
    syncs = [r for r in host if r.name in SYNC_OPS]
    span = (max(r.end_us for r in records) - min(r.start_us for r in records)) / 1e3 if records else 0.0
    return {"step_ms": span, "device": device_summary(kernels), "families": family_table(kernels),
            "kernels": top_by_name(kernels),
            "host": {"launches": len(launches), "launch_ms": sum(r.us for r in launches) / 1e3,
                     "syncs": top_by_name(syncs), "ops": top_by_name(
                         [r for r in host if r.name.startswith("aten::")], self_time=True, top=20)},
            "sync_sites": sync_sites or []}


def records_of(events) -> list[Record]:
    """Records of torch.profiler's FunctionEvents (`profile.events()`): kernels by their device type. A
    record_function's range on the device (`Optimizer.step#AdamW.step`) spans kernels and is none: it is left out,
    as torch's own tables leave it out of device time."""
    from torch.autograd import DeviceType

    return [Record(e.name, e.device_type == DeviceType.CUDA, e.time_range.start, e.time_range.end,
                   None if e.device_type == DeviceType.CUDA else e.self_cpu_time_total) for e in events
            if not (e.device_type == DeviceType.CUDA and getattr(e, "is_user_annotation", False))]


def sync_sites_of(events, roots: tuple[str, ...] = ("megalite/", "tools/")) -> list[dict]:
    """Each sync op's innermost Python frame under `roots` (events recorded with_stack=True), counted."""
    sites = Counter()
    for e in events:
        if e.name not in SYNC_OPS:
            continue
        event, frame = e, None
        while event is not None and frame is None:  # the Python frames are the op's ancestors (or its stack)
            frame = next((f for f in [event.name, *(event.stack or [])] if any(root in f for root in roots)), None)
            event = event.cpu_parent
        sites[e.name, frame or "outside megalite"] += 1
    return [{"op": op, "site": site, "count": n} for (op, site), n in sites.most_common(TOP)]
