"""Training curves from one or more metrics files (pretrain_gpt.py --logging.metrics_file=FILE) as a PNG.

One panel per figure a run logs: loss (training, and validation where it was evaluated, dashed), learning
rate, gradient norm, tokens per second and MFU; each file is one line in every panel, so runs compare at a
glance. Panels with no values in any file (MFU on a CPU, which has no known peak) are left out.

    python tools/plot_metrics.py runs/quickstart/metrics.jsonl --output runs/quickstart/curves.png
    python tools/plot_metrics.py a/metrics.jsonl b/metrics.jsonl --labels "lr 3e-4" "lr 1e-3" --panels loss lr

Needs matplotlib: pip install -e ".[plot]".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script Python puts tools/ first, not the root
from tools.plotting import pyplot  # noqa: E402

# panel -> (title, the record keys drawn in it: the first solid, the rest dashed)
PANELS = {
    "loss": ("loss", ("loss", "val_loss")),
    "lr": ("learning rate", ("lr",)),
    "grad_norm": ("gradient norm", ("grad_norm",)),
    "tokens_per_sec": ("tokens/s", ("tokens_per_sec",)),
    "mfu": ("MFU", ("mfu",)),
}
LABELS = {"loss": "train", "val_loss": "validation"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files (logging.metrics_file)")
    p.add_argument("--output", "-o", type=Path, default=Path("metrics.png"), help="PNG to write (default: %(default)s)")
    p.add_argument("--labels", nargs="+", help="one per file (default: each file's folder name)")
    p.add_argument("--panels", nargs="+", choices=list(PANELS), default=list(PANELS),
                   help="which panels to draw (default: every one with values)")
    p.add_argument("--title", help="the figure's title")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        p.error(f"--labels gives {len(args.labels)} names for {len(args.metrics)} metrics files")
    return args


def read_series(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values) of every finite number logged under key in the file."""
    if not path.is_file():
        raise SystemExit(f"error: {path}: no such metrics file (pretrain_gpt.py --logging.metrics_file writes one)")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SystemExit(f"error: {path}:{number}: not a JSON record; is this a metrics file?") from None
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                steps, values = series.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(value)
    return series


def draw(runs: dict[str, dict[str, tuple[list[int], list[float]]]], panels: list[str], title: str | None,
         output: Path) -> list[str]:
    """Draw the panels with values into `output`; returns the panels drawn."""
    shown = [name for name in panels if any(key in series for series in runs.values() for key in PANELS[name][1])]
    if not shown:
        raise SystemExit(f"error: no values for {', '.join(panels)} in the metrics files")
    plt = pyplot()
    columns = 2 if len(shown) == 4 else min(len(shown), 3)
    rows = -(-len(shown) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, name in zip(axes.flat, shown):
        heading, keys = PANELS[name]
        for index, (label, series) in enumerate(runs.items()):
            for style, key in zip(("-", "--"), keys):
                if key in series:
                    detail = f" ({LABELS[key]})" if len(keys) > 1 else ""
                    ax.plot(*series[key], style, color=colours(index % 10), label=f"{label}{detail}",
                            marker="o" if style == "--" else None, markersize=3)
        ax.set_title(heading)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return shown


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    labels = args.labels or [path.resolve().parent.name for path in args.metrics]
    if len(set(labels)) < len(labels):  # files in folders of the same name: tell them apart by their paths
        labels = [str(path) for path in args.metrics]
    runs = {label: read_series(path) for label, path in zip(labels, args.metrics)}
    shown = draw(runs, args.panels, args.title, args.output)
    print(f"wrote {args.output} ({', '.join(shown)})")


if __name__ == "__main__":
    main()
