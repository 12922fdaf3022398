"""The distributed optimizer's state as Megatron-LM lays it out, flat over its gradient buffers, mapped back to
whole tensors per parameter: torch_dist's default (`dp_reshardable`) and the legacy `distrib_optim.pt`.

Each optimizer (the dense parameters'; with experts split over ep or a different etp, the experts' after it:
Megatron chains them, prefixing torch_dist keys `chained_<k>.`) is saved per model-parallel rank, its
`dp_group_idx` the rank in the model-parallel group: tp_rank + tp * pp_rank for the dense optimizer,
etp_rank + etp * (ep_rank + ep * pp_rank) for the experts' (Megatron's rank order tp-cp-ep-dp-pp, groups
sorted by global rank). Its buffers (`gbuf_idx`) are the model chunks holding its parameters, in order; each
bucket a flat tensor of its unpadded size over the data-parallel ranks' shards. param_order.py says which
parameters each rank's chunk holds and in what order, buffer_layout.py where each lies; the pieces are then
merged over tensor (and expert) parallelism as the weights are.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megalite.checkpoint.megatron.buffer_layout import Param, Slot, bucket_slots
from megalite.checkpoint.megatron.names import Sharding, merge_tensor_parallel, split_tensor_parallel
from megalite.checkpoint.megatron.param_order import RankParam, chunk_parameters, chunks, experts_separate
from megalite.checkpoint.megatron.state import MAIN, arg

KINDS = {"param": MAIN, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
FLAT = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(.+)")
BUCKET = re.compile(r"gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")


@dataclass(frozen=True)
class Rank:
    """Where a model-parallel rank sits: its pipeline rank, its (expert) tensor-parallel rank and size, its
    expert-parallel rank."""

    pp: int
    tp: int
    tp_size: int
    ep: int = 0


def optimizers(args: argparse.Namespace) -> list[tuple[bool, list[int]]]:
    """Megatron's chained optimizers, in order: (for the experts, the model chunks it holds)."""
    vp = chunks(args)
    dense = ([(False, [c]) for c in range(vp)] if arg(args, "overlap_param_gather_with_optimizer_step", False)
             else [(False, list(range(vp)))])
    return dense + ([(True, list(range(vp)))] if arg(args, "num_experts") and experts_separate(args) else [])


def rank_of(args: argparse.Namespace, experts: bool, index: int) -> Rank:
    """The rank a `dp_group_idx` names (module docstring)."""
    tp = args.tensor_model_parallel_size
    if not experts:
        return Rank(index // tp, index % tp, tp)
    etp = arg(args, "expert_tensor_parallel_size") or tp
    ep = args.expert_model_parallel_size
    return Rank(index // (etp * ep), index % etp, etp, index // etp % ep)


class Pieces:
    """Each rank's piece of every parameter's optimizer state, merged into whole tensors at the end."""

    def __init__(self, weights: dict[str, torch.Tensor], sharding: Sharding) -> None:
        self.weights, self.sharding = weights, sharding
        self.parts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))

    def shape(self, param: RankParam, rank: Rank) -> torch.Size:
        """The shape of the rank's piece of `param`, from the whole weight."""
        name = "embedding.word_embeddings.weight" if param.shared and param.name == "output_layer.weight" \
            else param.name
        whole = self.weights[name] if param.expert is None else self.weights[name][param.expert:param.expert + 1]
        shape = split_tensor_parallel(name, whole, rank.tp_size, self.sharding)[rank.tp].shape
        return shape if param.expert is None else shape[1:]

    def add(self, param: RankParam, rank: Rank, kind: str, piece: torch.Tensor) -> None:
        self.parts[param.key][kind][rank.tp] = piece

    def whole(self, where: str) -> dict[str, dict[str, torch.Tensor]]:
        """Whole tensors by Megatron's name -> kind; experts stacked in expert order."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
        for key, kinds in self.parts.items():
            name, _, expert = key.partition("[")
            for kind, ranks in kinds.items():
                merged = merge_tensor_parallel(name, [ranks[r].unsqueeze(0) if expert else ranks[r]
                                                      for r in sorted(ranks)], self.sharding, where)
                if expert:
                    experts[name][kind][int(expert[:-1])] = merged[0]
                else:
                    out.setdefault(name, {})[kind] = merged
        for name, kinds in experts.items():
            out[name] = {kind: torch.stack([by[e] for e in sorted(by)]) for kind, by in kinds.items()}
        return out


def place_buffer(params: list[RankParam], flat: Callable[[int, str], torch.Tensor], slots: dict[str, Slot],
                 pieces: Pieces, rank: Rank) -> None:
    """Every parameter's piece of one buffer, cut from its bucket tensors (`flat(bucket, kind)`)."""
    for param in params:
        slot = slots[param.key]
        for theirs, ours in KINDS.items():
            pieces.add(param, rank, ours, flat(slot.bucket, theirs)[slot.span.start:slot.span.stop]
                       .view(pieces.shape(param, rank)))


def buffer_params(names: list[str], args: argparse.Namespace, rank: Rank, chunk: int, experts: bool,
                  pieces: Pieces) -> tuple[list[RankParam], list[Param]]:
    """One buffer's parameters (the rank's chunk, dense or experts), and their sizes for the layout."""
    only = experts if experts_separate(args) and arg(args, "num_experts") else None
    params = chunk_parameters(names, args, rank.pp, chunk, rank.ep, only)
    return params, [Param(p.key, pieces.shape(p, rank).numel(), p.shared) for p in params]


def read_dp_reshardable(entries: dict[str, object], read_object: Callable[[str], object],
                        read_tensor: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor],
                        args: argparse.Namespace, where: str) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """(Megatron's name -> {main, exp_avg, exp_avg_sq}, Adam's step) from torch_dist's flat-bucket entries."""
    plan = optimizers(args)
    groups: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for name in entries:
        match = FLAT.fullmatch(name)
        groups[(int(match.group(1) or 0), int(match.group(2)))][match.group(3)] = name
    pieces, names, steps = Pieces(weights, Sharding.of(args)), list(weights), set()
    for (k, index), items in sorted(groups.items()):
        if k >= len(plan):
            raise ValueError(f"{where}: optimizer entries chained_{k}.* but Megatron's args give {len(plan)} "
                             "optimizers; convert with --no-optimizer to carry the weights only")
        experts, chunk_list = plan[k]
        rank = rank_of(args, experts, index)
        prefix = f"chained_{k}." if len(plan) > 1 else ""
        label = f"{where}: {prefix}optimizer.distributed.dp_group_idx_{index}"
        sizes = read_object(items["per_bucket_numel_unpadded/shard_0_1"])[0]
        steps |= {int(g["step"]) for g in read_object(items["optimizer/shard_0_1"])[0]["param_groups"] if "step" in g}
        buffers = [(c, *buffer_params(names, args, rank, c, experts, pieces)) for c in chunk_list]
        buffers = [b for b in buffers if b[1]]
        if len(buffers) != len(sizes):
            raise ValueError(f"{label}: {len(sizes)} buffers saved, megalite expects {len(buffers)} (one per model "
                             "chunk holding this optimizer's parameters)")
        for g, (chunk, params, layout) in enumerate(buffers):
            (dtype, bucket_sizes), = sizes[g].items()
            slots, _ = bucket_slots(layout, f"{label} buffer {g} (model chunk {chunk})", sizes=bucket_sizes)

            def flat(bucket: int, kind: str, g=g, dtype=dtype, items=items) -> torch.Tensor:
                return read_tensor(items[f"gbuf_idx_{g}.dtype_{dtype}.bucket_idx_{bucket}.{kind}"])

            place_buffer(params, flat, slots, pieces, rank)
    if len(steps) != 1:
        raise ValueError(f"{where}: the optimizers' param groups give Adam steps {sorted(steps)}; expected one")
    return pieces.whole(where), steps.pop()
