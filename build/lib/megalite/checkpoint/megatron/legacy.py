"""Megatron-LM's legacy `torch` checkpoint format, read rank file by rank file.

`iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` (TT the tensor-parallel rank, PPP the pipeline rank when pp > 1)
holds `args`, `iteration`, `model` (the rank's shards, layers numbered within the pipeline stage) and
`optimizer`: torch's Adam state by parameter index, wrapped with fp32 main weights under bf16/fp16, or under
the distributed optimizer only its param groups, Adam's state then being in `distrib_optim.pt` beside it,
flat over the gradient buffer (buffer_layout.py). Data-parallel ranks hold copies, saved once.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import torch

from megalite.checkpoint.megatron.buffer_layout import bucket_size, flat_ranges
from megalite.checkpoint.megatron.names import IGNORED_SUFFIX, known, layer_numbers, merge_tensor_parallel, renumber
from megalite.checkpoint.megatron.safe_pickle import load_megatron_pickle
from megalite.checkpoint.megatron.state import MAIN, MOMENTS, MegatronState

RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
TIED_COPIES = ("embedding.word_embeddings.weight", "output_layer.weight")
RankOptimizer = dict[str, dict[str, torch.Tensor]]


def _rank_file(found: Path, tp_rank: int, pp_rank: int, pp: int) -> Path:
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    path = found / name / "model_optim_rng.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a legacy Megatron-LM checkpoint needs one file per tensor- "
                                "and pipeline-parallel rank")
    return path


def _model(saved: dict, path: Path) -> dict[str, torch.Tensor]:
    """The rank's weights (every name one megalite has a place for)."""
    if "model" not in saved:
        found = sorted(k for k in saved if k.startswith("model"))
        raise ValueError(f"{path}: no 'model' entry (found {found}): checkpoints saved with virtual pipeline "
                         "stages are not supported; re-save it with --virtual-pipeline-model-parallel-size unset")
    model = {k: v for k, v in saved["model"].items() if not k.endswith(IGNORED_SUFFIX)}
    for name in model:
        known(name, str(path))
    return model


def _no_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron's default: no weight decay on biases and one-dimensional parameters (its param groups)."""
    return tensor.ndim == 1 or name.endswith(".bias")


def _plain_optimizer(saved: dict, model: dict[str, torch.Tensor], path: Path) -> tuple[RankOptimizer, int | None]:
    """Adam's state by parameter name: torch's state is by index into the param groups, which list the
    parameters of each group (weight decay or not) in the model's order."""
    outer = saved["optimizer"]
    inner = outer.get("optimizer", outer)
    mains = outer.get("fp32_from_fp16_params")
    out, step = {}, None
    for g, group in enumerate(inner["param_groups"]):
        no_decay = group.get("wd_mult", group.get("weight_decay")) == 0
        names = [n for n, t in model.items() if _no_decay(n, t) == no_decay]
        if len(names) != len(group["params"]):
            raise ValueError(f"{path}: optimizer param group {g} holds {len(group['params'])} parameters, megalite "
                             f"expected {len(names)} (Megatron's default groups: with and without weight decay); "
                             "convert with --no-optimizer to carry the weights only")
        for j, (name, index) in enumerate(zip(names, group["params"])):
            state = inner["state"].get(index, {})
            if not state:
                continue
            out[name] = {kind: state[kind] for kind in MOMENTS}
            if mains is not None:
                out[name][MAIN] = mains[g][j]
            step = int(state["step"])
            if any(t.shape != model[name].shape for t in out[name].values()):
                raise ValueError(f"{path}: optimizer state {index} does not have the shape of {name} "
                                 f"{tuple(model[name].shape)}; its param groups are not in the model's order")
    return out, step


def _distributed_optimizer(file: Path, model: dict[str, torch.Tensor], args: argparse.Namespace, pp_rank: int,
                           groups: list[dict]) -> tuple[RankOptimizer, int | None]:
    saved = load_megatron_pickle(file, str(file))
    if not saved.get("buckets_coalesced") or set(saved) - {"buckets_coalesced", 0}:
        raise ValueError(f"{file}: entries {sorted(map(str, saved))} not understood (megalite reads one model "
                         "chunk's coalesced buckets); convert with --no-optimizer to carry the weights only")
    if len(saved[0]) != 1:
        raise ValueError(f"{file}: buffers {list(saved[0])}: megalite reads one buffer (one parameter dtype)")
    flat = next(iter(saved[0].values()))
    tied = not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size > 1
    numels = [(n, t.numel(), tied and n in TIED_COPIES) for n, t in model.items()]
    where, total = flat_ranges(numels, bucket_size(args, pp_rank))
    if total != flat["numel_unpadded"]:
        raise ValueError(f"{file}: {flat['numel_unpadded']} elements, but megalite's reading of Megatron's buffer "
                         f"layout gives {total}; this Megatron version lays its buffer out otherwise")
    kinds = {"param": MAIN, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    out = {name: {ours: flat[theirs][span.start:span.stop].view_as(model[name]) for theirs, ours in kinds.items()}
           for name, span in where.items()}
    steps = {int(group["step"]) for group in groups if "step" in group}
    return out, steps.pop() if len(steps) == 1 else None


def _rank_state(path: Path, saved: dict, args: argparse.Namespace, pp_rank: int, with_optimizer: bool):
    """(weights, optimizer state, Adam step) of one rank file, layers numbered within its stage."""
    model = _model(saved, path)
    if with_optimizer and (path.parent / "distrib_optim.pt").is_file():
        groups = saved["optimizer"]["optimizer"]["param_groups"]
        return model, *_distributed_optimizer(path.parent / "distrib_optim.pt", model, args, pp_rank, groups)
    if with_optimizer and "optimizer" in saved:
        return model, *_plain_optimizer(saved, model, path)
    return model, {}, None


def read_legacy(found: Path, check: Callable[[argparse.Namespace], None], with_optimizer: bool) -> MegatronState:
    """The checkpoint in `found` (its optimizer state only `with_optimizer`); `check` sees its args before the
    other ranks' files are read."""
    first = _rank_file(found, 0, 0, 2 if (found / "mp_rank_00_000").is_dir() else 1)
    head = load_megatron_pickle(first, str(first))
    args = head["args"]
    check(args)

    def load(path: Path) -> dict:
        return head if path == first else load_megatron_pickle(path, str(path))

    tp, pp, swiglu = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.swiglu
    weights, optimizer, steps, offset = {}, {}, set(), 0
    for p in range(pp):
        paths = [_rank_file(found, t, p, pp) for t in range(tp)]
        ranks = [_rank_state(path, load(path), args, p, with_optimizer) for path in paths]
        where = str(paths[0])
        for path, rank in zip(paths, ranks):
            if rank[0].keys() != ranks[0][0].keys():
                raise ValueError(f"{path} holds tensors {sorted(rank[0].keys() ^ ranks[0][0].keys())} that {where} "
                                 "does not, or the reverse: the ranks of one stage must hold the same tensors")
        for name in ranks[0][0]:
            weights[renumber(name, offset)] = merge_tensor_parallel(name, [r[0][name] for r in ranks], swiglu, where)
        for name in ranks[0][1]:
            optimizer[renumber(name, offset)] = {
                kind: merge_tensor_parallel(name, [r[1][name][kind] for r in ranks], swiglu, where)
                for kind in ranks[0][1][name]}
        steps |= {r[2] for r in ranks if r[2] is not None}
        offset += len(layer_numbers(list(ranks[0][0])))
    if len(steps) > 1:
        raise ValueError(f"{found}: ranks disagree on Adam's step ({sorted(steps)}); the checkpoint is inconsistent")
    return MegatronState(found, args, int(head["iteration"]), weights, optimizer, steps.pop() if steps else None)
