"""The machine a layout search plans for: how many GPUs, which GPU, and the links between them.

A GPU is its memory (planning/plan.py GPUS, what torch.cuda reports) and its dense peak (training/flops.py
PEAK_TFLOPS): both tables stay where they are; this module only names their rows. Links are per GPU and per
direction, as a collective's bus bandwidth is counted (NCCL's tests): within a node NVLink, half the bidirectional
figure vendors quote (NVLink 4 on H100/H200: 900 GB/s, so 450 GB/s each way; NVLink 3 on A100 600; NVLink 5 on
B200 1,800); between nodes one NIC per GPU (InfiniBand NDR 400 Gb/s = 50 GB/s on H100/H200/B200, HDR 200 Gb/s on
A100). Both are overridable (tools/plan.py --nvlink-gbs, --network-gbits). NCCL reaches about
LINK_EFFICIENCY of a link's figure with large messages; the time model divides by that.

Which link an axis's groups cross follows megalite's rank order (parallel/topology.py RankGrid: tp fastest, then
cp, dp, pp; the expert grid etp, ep, edp, pp) and torchrun's placement (node = rank // GPUs per node): a group
whose ranks share a node talks over NVLink, any other over the network, where its slowest hop sets the pace.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megalite.parallel.topology import RankGrid

LINK_EFFICIENCY = 0.8  # share of a link's figure NCCL's large collectives reach (its busbw on H100 NVLink / NDR)

# GPU -> (NVLink GB/s bidirectional per GPU, network Gb/s per GPU): the defaults of each known GPU.
DEFAULT_LINKS = {"h100": (900.0, 400.0), "h200": (900.0, 400.0), "gh200": (900.0, 400.0), "b200": (1800.0, 400.0),
                 "a100": (600.0, 200.0), "a100-40gb": (600.0, 200.0)}
FALLBACK_LINKS = (600.0, 200.0)  # a GPU not above (PCIe parts): NVLink 3's and HDR's figures


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs of kind `gpu` (a planning/plan.py GPUS key), NVLink inside a node and the
    network between nodes, each as quoted (GB/s both ways per GPU; Gb/s per GPU)."""

    nodes: int
    gpus_per_node: int
    gpu: str = "h100"
    nvlink_gbs: float | None = None  # None: the GPU's default (DEFAULT_LINKS)
    network_gbits: float | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def links(self) -> tuple[float, float]:
        """(NVLink, network) as quoted: the GPU's defaults unless overridden."""
        nvlink, network = DEFAULT_LINKS.get(self.gpu, FALLBACK_LINKS)
        return self.nvlink_gbs or nvlink, self.network_gbits or network

    @property
    def intra_bytes_per_s(self) -> float:
        """One direction of NVLink, at the efficiency NCCL reaches."""
        return self.links[0] / 2 * 1e9 * LINK_EFFICIENCY

    @property
    def inter_bytes_per_s(self) -> float:
        """One GPU's NIC, one direction, at the efficiency NCCL reaches."""
        return self.links[1] / 8 * 1e9 * LINK_EFFICIENCY

    def describe(self) -> str:
        nvlink, network = self.links
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} {self.gpu} "
                f"(NVLink {nvlink:g} GB/s per GPU both ways, network {network:g} Gb/s per GPU; "
                f"{LINK_EFFICIENCY:.0%} of each reached)")

    def bandwidth(self, grid: RankGrid, axes: tuple[str, ...]) -> tuple[float, bool]:
        """(bytes/s per direction, crosses nodes) of the groups along `axes` of `grid`."""
        crosses = spans_nodes(grid, axes, self.gpus_per_node)
        return (self.inter_bytes_per_s if crosses else self.intra_bytes_per_s), crosses


@functools.lru_cache(maxsize=4096)
def spans_nodes(grid: RankGrid, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether a group along `axes` holds ranks of different nodes (each group of a grid has the same strides,
    so the one of rank 0 stands for all)."""
    if all(grid.size(axis) == 1 for axis in axes):
        return False
    group = grid.groups(axes)[0]
    return len({rank // gpus_per_node for rank in group}) > 1
