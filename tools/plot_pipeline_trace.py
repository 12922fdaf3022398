"""Draw one step of a pipeline trace (pretrain_gpt.py --logging.pipeline_trace=FILE) as a PNG.

Why: the Chrome trace is best explored in Perfetto, but a README needs a still picture, and a
picture from a real run shows the warm-up, the steady 1F1B phase and the bubbles as they were,
not as a textbook draws them. One row per rank; forwards in blue, backwards in orange (under a zero-bubble
schedule: input gradients, B), weight gradients (W) in green, a darker shade per model chunk, each box
labelled with its micro batch; a paired F&B (DualPipeV) as half-height boxes, its forward above its backward.

    python tools/plot_pipeline_trace.py trace.json docs/images/interleaved_schedule.png [--step N] [--title TEXT]

Needs matplotlib: pip install -e ".[plot]".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script Python puts tools/ first, not the root
from tools.plotting import pyplot  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="Chrome trace written by logging.pipeline_trace")
    p.add_argument("output", type=Path, help="PNG to write")
    p.add_argument("--step", type=int, help="which recorded step to draw, from 1 (default: the last)")
    p.add_argument("--title", help="title (default: the layout read from the trace)")
    return p.parse_args(argv)


def load_step(trace: dict, step: int | None) -> tuple[dict[int, list[dict]], dict[int, str]]:
    """Per rank, the events of one recorded step (every rank runs the same number of ops per step)."""
    steps = trace["otherData"]["steps"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    per_rank: dict[int, list[dict]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") == "X":
            per_rank[event["pid"]].append(event)
    index = (step or steps) - 1
    if not 0 <= index < steps:
        raise SystemExit(f"--step {step}: the trace recorded steps 1..{steps}")
    chosen = {}
    for rank, events in per_rank.items():
        events.sort(key=lambda e: e["ts"])
        size = len(events) // steps
        chosen[rank] = events[index * size:(index + 1) * size]
    return chosen, names


def draw(events: dict[int, list[dict]], names: dict[int, str], title: str, output: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    origin = min(e["ts"] for evs in events.values() for e in evs)
    chunks = 1 + max(e["args"]["chunk"] for evs in events.values() for e in evs)
    colours = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges"), "W": plt.get_cmap("Greens")}
    shade = lambda kind, chunk: colours[kind](0.45 + 0.4 * chunk / max(chunks - 1, 1))  # noqa: E731
    ranks = sorted(events)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.7 * len(ranks)))
    for row, rank in enumerate(ranks):
        for e in events[rank]:
            start, width = (e["ts"] - origin) / 1e3, e["dur"] / 1e3
            paired = e["args"].get("paired", False)  # half a row: the forward above, the backward below
            y = row + (0.2 if e["name"][0] == "B" else -0.2) * paired
            ax.barh(y, width, left=start, height=0.4 if paired else 0.8,
                    color=shade(e["name"][0], e["args"]["chunk"]), edgecolor="black", linewidth=0.5)
            ax.text(start + width / 2, y, str(e["args"]["microbatch"]), ha="center", va="center",
                    fontsize=6 if paired else 8)
    ax.set_yticks(range(len(ranks)), [names.get(r, f"rank {r}").split(";")[0] + ")" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the step's first operation; numbers: micro batch; "
                  "a box includes waiting for its input; half boxes: a paired F&B")
    ax.set_title(title)
    kinds = [kind for kind in "FBW" if any(e["name"][0] == kind for evs in events.values() for e in evs)]
    label = {"F": "forward", "B": "backward" if "W" not in kinds else "B (input grad)", "W": "W (weight grad)"}
    legend = [Patch(color=shade(kind, c), label=f"{label[kind]}, chunk {c}") for kind in kinds for c in range(chunks)]
    fig.legend(handles=legend, loc="lower center", ncol=len(kinds) * chunks, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trace = json.loads(args.trace.read_text())
    events, names = load_step(trace, args.step)
    chunks = 1 + max(e["args"]["chunk"] for evs in events.values() for e in evs)
    microbatches = 1 + max(e["args"]["microbatch"] for evs in events.values() for e in evs)
    title = args.title or (f"pipeline schedule: {len(events)} ranks, {chunks} chunks per rank, "
                           f"{microbatches} micro batches")
    draw(events, names, title, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
