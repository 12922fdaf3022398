"""Draw how megalite places ranks on nodes for a layout, as a PNG (the README's rank-grid picture).

Why: "tensor-parallel ranks are adjacent, then data-parallel, then pipeline" is easy to say and
easy to misread; the picture shows which GPUs of which node form each group. Ranks come from
megalite.parallel.topology.RankGrid, the grid training uses. Each box is a GPU: its global
rank and (pp, dp, tp) coordinates; colour = pipeline stage; a thick outline = one tensor-parallel group.

    python tools/plot_rank_grid.py docs/images/rank_grid.png --tp 2 --pp 2 --dp 4 --gpus-per-node 8

Needs matplotlib (pip install -e ".[plot]").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script Python puts tools/ first, not the root
from megalite.parallel.topology import RankGrid  # noqa: E402
from tools.plotting import pyplot  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", type=Path)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    return p.parse_args(argv)


def draw(tp: int, pp: int, dp: int, per_node: int, output: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Rectangle

    world = tp * pp * dp
    grid = RankGrid.dense(tp=tp, dp=dp, pp=pp)
    nodes = -(-world // per_node)
    colours = plt.get_cmap("Pastel1")
    fig, ax = plt.subplots(figsize=(1.5 * per_node + 1.5, 1.5 * nodes + 1.2))
    for rank in range(world):
        s, d, t = (grid.coords(rank)[axis] for axis in ("pp", "dp", "tp"))
        node, gpu = divmod(rank, per_node)
        ax.add_patch(Rectangle((gpu, -node), 0.92, 0.8, facecolor=colours(s), edgecolor="grey"))
        ax.text(gpu + 0.46, -node + 0.52, f"rank {rank}", ha="center", fontsize=10, weight="bold")
        ax.text(gpu + 0.46, -node + 0.2, f"pp {s} dp {d} tp {t}", ha="center", fontsize=8)
        if t == 0:  # outline the whole tensor-parallel group (adjacent ranks, inside one node)
            ax.add_patch(Rectangle((gpu - 0.04, -node - 0.05), tp - 0.04, 0.9, fill=False, linewidth=2.5,
                                   edgecolor="black"))
    for node in range(nodes):
        ax.text(-0.2, -node + 0.4, f"node {node}", ha="right", va="center", fontsize=11)
    ax.set_xlim(-1.4, per_node + 0.1)
    ax.set_ylim(-nodes + 0.85, 1.2)
    ax.axis("off")
    ax.set_title(f"world {world} = tp {tp} x pp {pp} x dp {dp} on {nodes} nodes of {per_node} GPUs: "
                 "colour = pipeline stage, outline = tensor-parallel group\n"
                 "data-parallel group = same pp and tp; pipeline group = same dp and tp", fontsize=10)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    draw(args.tp, args.pp, args.dp, args.gpus_per_node, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
