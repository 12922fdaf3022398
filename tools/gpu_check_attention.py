"""tools/gpu_check.py's `attention` step: sliding-window attention with sinks at long sequences, timed and its
memory read (tools/benchmark_attention.py), against full causal attention and against SDPA given the window as a
mask. Goals: the windowed kernel keeps no score matrix (its peak within 1.5x causal flash's) and skips what the
window leaves out (no slower than causal attention over the whole sequence)."""

from __future__ import annotations

import re
import shlex
import sys

from tools.gpu_check_report import CheckResult, Goal

COMMAND = [sys.executable, "tools/benchmark_attention.py", "--device", "cuda"]
RESULT = re.compile(r"^RESULT (.+?) seq=(\d+) (?:ms=([\d.]+) peak_gib=([\d.]+)|failed=(\S+))$", re.M)
SOURCE = "tools/benchmark_attention.py"


def parse(output: str) -> dict[tuple[str, int], tuple[float, float] | str]:
    """(way, seq) -> (milliseconds, peak GiB), or the error that stopped it."""
    return {(way, int(seq)): (float(ms), float(peak)) if ms else error
            for way, seq, ms, peak, error in RESULT.findall(output)}


def _goals(results: dict) -> list[Goal]:
    goals = []
    for seq in sorted({seq for _, seq in results}):
        ours, causal = results.get(("window+sinks", seq)), results.get(("causal", seq))
        if not isinstance(ours, tuple) or not isinstance(causal, tuple):
            continue
        goals += [Goal(f"window+sinks peak memory <= 1.5x causal flash, seq {seq}",
                       f"{ours[1]:.2f} vs {causal[1]:.2f} GiB", ours[1] <= 1.5 * causal[1], SOURCE),
                  Goal(f"window+sinks time <= causal flash, seq {seq}", f"{ours[0]:.2f} vs {causal[0]:.2f} ms",
                       ours[0] <= causal[0], SOURCE)]
    return goals


def step_attention(ctx) -> CheckResult:
    """Runs the benchmark within its limit; FAIL when it does not finish or the windowed kernel did not run."""
    rc, output = ctx.run("attention", COMMAND, 120)
    results = parse(output)
    rows = [f"| {way} | {seq} | " + (f"{value[0]:.2f} | {value[1]:.2f} |" if isinstance(value, tuple)
                                     else f"failed: {value} | |") for (way, seq), value in results.items()]
    ran = [value for (way, _), value in results.items() if way == "window+sinks"]
    status = "PASS" if rc == 0 and ran and all(isinstance(v, tuple) for v in ran) else "FAIL"
    summary = "; ".join(f"{way} seq {seq}: {value[0]:.2f} ms, {value[1]:.2f} GiB" if isinstance(value, tuple)
                        else f"{way} seq {seq}: {value}" for (way, seq), value in results.items())
    details = [f"`{shlex.join(['python', *COMMAND[1:]])}`: one forward+backward (bf16, median of 5), peak "
               "allocated beyond the inputs.", "", "| way | seq | ms | peak GiB |", "|---|---:|---:|---:|", *rows]
    if status == "FAIL":
        details += ["", "```", *output.rstrip().splitlines()[-30:], "```"]
    return CheckResult("attention", status, summary or f"exit status {rc}, no result lines", details, _goals(results))
