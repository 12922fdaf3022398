"""Megatron-LM's legacy `torch` checkpoint format, read rank file by rank file.

`iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` (TT the tensor-parallel rank, PPP the pipeline rank when
pp > 1, EEE the expert-parallel rank when ep > 1) holds `args`, `iteration`, the rank's shards (`model`, or
`model0`, `model1`, ... per virtual pipeline stage; layers numbered within the chunk, experts within the rank:
`mlp.experts.local_experts.<i>.*`, or `mlp.experts.*.weight<i>` with Transformer Engine's grouped experts) and
`optimizer`: torch's Adam state by parameter index, wrapped with fp32 main weights under bf16/fp16, or under
the distributed optimizer only its param groups (a list of them, one per chained optimizer, with experts), Adam's
state then being in `distrib_optim.pt` beside it, flat over the gradient buffers (buffer_layout.py): the state
of each chained optimizer, the dense one's in the expert-parallel rank 0 files only (`None` in the others).
Data-parallel ranks hold copies, saved once.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import torch

from megalite.checkpoint.megatron.buffer_layout import Param, bucket_size, bucket_slots, coalesced
from megalite.checkpoint.megatron.flat_state import Pieces, Rank, optimizers
from megalite.checkpoint.megatron.names import (
    GROUPED_EXPERT,
    IGNORED_SUFFIX,
    LAYER,
    LOCAL_EXPERT,
    Sharding,
    known,
    layer_numbers,
    layer_part,
)
from megalite.checkpoint.megatron.param_order import TIED_COPIES, RankParam, chunk_layers, chunks, experts_separate
from megalite.checkpoint.megatron.safe_pickle import load_megatron_pickle
from megalite.checkpoint.megatron.state import MAIN, MOMENTS, MegatronState, arg

RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
RankOptimizer = dict[str, dict[str, torch.Tensor]]
Chunk = list[tuple[RankParam, torch.Tensor]]


def _rank_file(found: Path, tp_rank: int, pp_rank: int, ep_rank: int, args: argparse.Namespace) -> Path:
    name = (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if args.pipeline_model_parallel_size > 1 else "")
            + (f"_{ep_rank:03d}" if arg(args, "expert_model_parallel_size", 1) > 1 else ""))
    path = found / name / "model_optim_rng.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a legacy Megatron-LM checkpoint needs one file per tensor-, "
                                "pipeline- and expert-parallel rank")
    return path


def _canonical(name: str, layers: list[int], ep_rank: int, per_rank: int) -> RankParam:
    """The rank's tensor `name` under its whole-model name: global layer (a multi-token-prediction layer's number
    is the same on every rank); experts stacked, global expert index."""
    part = layer_part(name)
    if not part:
        return RankParam(name)
    match, (prefix, inner) = LAYER.fullmatch(name), part
    if match:
        prefix = f"decoder.layers.{layers[int(match.group(1))]}."
    expert = LOCAL_EXPERT.fullmatch(inner) or GROUPED_EXPERT.fullmatch(inner)
    if expert is None:
        return RankParam(prefix + inner)
    local, projection = (expert.group(1), expert.group(2)) if expert.re is LOCAL_EXPERT else expert.group(2, 1)
    return RankParam(f"{prefix}mlp.experts.{projection}", ep_rank * per_rank + int(local))


def _chunks(saved: dict, path: Path, args: argparse.Namespace, pp_rank: int, ep_rank: int) -> list[Chunk]:
    """The rank's model chunks: (whole-model parameter, its shard) in the file's (Megatron's registration)
    order."""
    vp = chunks(args)
    keys = ["model"] if vp == 1 else [f"model{v}" for v in range(vp)]
    if any(key not in saved for key in keys):
        raise ValueError(f"{path}: entries {keys} expected (args.virtual_pipeline_model_parallel_size="
                         f"{arg(args, 'virtual_pipeline_model_parallel_size')}), found "
                         f"{sorted(k for k in saved if k.startswith('model'))}")
    per_rank = (arg(args, "num_experts") or 0) // arg(args, "expert_model_parallel_size", 1)
    out = []
    for v, key in enumerate(keys):
        model = {k: t for k, t in saved[key].items() if not k.endswith(IGNORED_SUFFIX)}
        counted = sorted(layer_numbers(list(model)))
        layers = list(chunk_layers(args, pp_rank, v))
        if len(layers) != len(counted):
            raise ValueError(f"{path}: {key} holds layers {counted}, Megatron's even split gives {layers}")
        params = [(_canonical(name, layers, ep_rank, per_rank), t) for name, t in model.items()]
        for param, _ in params:
            known(param.name, str(path))
        out.append(params)
    return out


def _no_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron's default: no weight decay on biases and one-dimensional parameters (its param groups)."""
    return tensor.ndim == 1 or name.endswith(".bias")


def _plain_optimizer(saved: dict, model: Chunk, path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], int | None]:
    """Adam's state by parameter: torch's state is by index into the param groups, which list the parameters of
    each group (weight decay or not) in the model's order."""
    outer = saved["optimizer"]
    if isinstance(outer, list):
        raise ValueError(f"{path}: chained optimizers (experts) without the distributed optimizer are not read; "
                         "convert with --no-optimizer to carry the weights only")
    inner = outer.get("optimizer", outer)
    mains = outer.get("fp32_from_fp16_params")
    out, step = {}, None
    for g, group in enumerate(inner["param_groups"]):
        no_decay = group.get("wd_mult", group.get("weight_decay")) == 0
        members = [(p, t) for p, t in model if _no_decay(p.name, t) == no_decay]
        if len(members) != len(group["params"]):
            raise ValueError(f"{path}: optimizer param group {g} holds {len(group['params'])} parameters, megalite "
                             f"expected {len(members)} (Megatron's default groups: with and without weight decay); "
                             "convert with --no-optimizer to carry the weights only")
        for j, ((param, tensor), index) in enumerate(zip(members, group["params"])):
            state = inner["state"].get(index, {})
            if not state:
                continue
            out[param.key] = {kind: state[kind] for kind in MOMENTS} | ({MAIN: mains[g][j]} if mains else {})
            step = int(state["step"])
            if any(t.shape != tensor.shape for t in out[param.key].values()):
                raise ValueError(f"{path}: optimizer state {index} does not have the shape of {param.key} "
                                 f"{tuple(tensor.shape)}; its param groups are not in the model's order")
    return out, step


def _buffer(chunk: Chunk, experts: bool | None, tied: bool) -> list[tuple[RankParam, torch.Tensor]]:
    """One buffer's parameters of a chunk: the experts' (True), the rest (False), or all (None)."""
    return [(RankParam(p.name, p.expert, tied and p.name in TIED_COPIES), t) for p, t in chunk
            if experts is None or (p.expert is not None) == experts]


def _distributed_optimizer(file: Path, model: list[Chunk], args: argparse.Namespace, pp_rank: int,
                           ep_rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state and main weights of the rank's parameters, by key, from its `distrib_optim.pt`."""
    saved = load_megatron_pickle(file, str(file))
    plan = optimizers(args)
    states = saved if isinstance(saved, list) else [saved]
    if len(states) != len(plan):
        raise ValueError(f"{file}: {len(states)} optimizer states, Megatron's args give {len(plan)}; convert "
                         "with --no-optimizer to carry the weights only")
    tied = not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size > 1
    split = experts_separate(args) and arg(args, "num_experts")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for state, (experts, chunk_list) in zip(states, plan):
        if state is None:  # the dense optimizer's state lies in the expert-parallel rank 0 files
            continue
        if not state.get("buckets_coalesced"):
            raise ValueError(f"{file}: not the coalesced-bucket layout megalite reads (Megatron before 2024?); "
                             "convert with --no-optimizer to carry the weights only")
        buffers = [(c, _buffer(model[c], experts if split else None, tied)) for c in chunk_list]
        buffers = [(c, b) for c, b in buffers if b]
        for g, (c, params) in enumerate(buffers):
            (flat,) = state[g].values()
            layout = [Param(p.key, t.numel(), p.shared) for p, t in params]
            where = f"{file}: buffer {g} (model chunk {c})"
            slots, sizes = bucket_slots(layout, where, bucket_size=bucket_size(args, pp_rank, c))
            if sum(sizes) != flat["numel_unpadded"]:
                raise ValueError(f"{where}: {flat['numel_unpadded']} elements, but megalite's reading of Megatron's "
                                 f"buffer layout gives {sum(sizes)} (buckets {sizes})")
            spans = coalesced(slots, sizes)
            for p, t in params:
                span = spans[p.key]
                out[p.key] = {ours: flat[theirs][span.start:span.stop].view_as(t)
                              for theirs, ours in (("param", MAIN), ("exp_avg", "exp_avg"),
                                                   ("exp_avg_sq", "exp_avg_sq"))}
    return out


def _step(saved: dict) -> int | None:
    groups = saved["optimizer"]
    groups = [g for o in (groups if isinstance(groups, list) else [groups])
              for g in o.get("optimizer", o).get("param_groups", [])]
    steps = {int(group["step"]) for group in groups if "step" in group}
    return steps.pop() if len(steps) == 1 else None


def read_legacy(found: Path, check: Callable[[argparse.Namespace], None], with_optimizer: bool) -> MegatronState:
    """The checkpoint in `found` (its optimizer state only `with_optimizer`); `check` sees its args before the
    other ranks' files are read."""
    rank_dirs = sorted(p.parent for p in found.glob("mp_rank_*/model_optim_rng.pt"))
    head = load_megatron_pickle(rank_dirs[0] / "model_optim_rng.pt", str(rank_dirs[0] / "model_optim_rng.pt"))
    args = head["args"]
    check(args)
    tp, pp, sharding = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, Sharding.of(args)
    ep = arg(args, "expert_model_parallel_size", 1)
    if ep > 1 and (arg(args, "expert_tensor_parallel_size") or tp) != tp:
        raise ValueError(f"{found}: args.expert_tensor_parallel_size={args.expert_tensor_parallel_size} differs from "
                         f"tp={tp}: the legacy format's files then name other ranks than megalite reads")
    weights, states, steps = Pieces({}, sharding), Pieces({}, sharding), set()
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                path = _rank_file(found, t, p, e, args)
                saved = load_megatron_pickle(path, str(path))
                model = _chunks(saved, path, args, p, e)
                rank = Rank(p, t, tp, e)
                for param, tensor in (x for chunk in model for x in chunk):
                    if param.expert is not None or e == 0:
                        weights.add(param, rank, "weight", tensor)
                if not with_optimizer or "optimizer" not in saved:
                    continue
                optim_file = path.parent / "distrib_optim.pt"
                if optim_file.is_file():
                    found_state, step = _distributed_optimizer(optim_file, model, args, p, e), _step(saved)
                else:
                    found_state, step = _plain_optimizer(saved, [x for chunk in model for x in chunk], path)
                by_key = {param.key: param for chunk in model for param, _ in chunk}
                for key, kinds in found_state.items():
                    for kind, tensor in kinds.items():
                        states.add(by_key[key], rank, kind, tensor)
                steps |= {step} - {None}
    if len(steps) > 1:
        raise ValueError(f"{found}: ranks disagree on Adam's step ({sorted(steps)}); the checkpoint is inconsistent")
    merged = {name: kinds["weight"] for name, kinds in weights.whole(str(found)).items()}
    optimizer = states.whole(str(found)) if states.parts else {}
    return MegatronState(found, args, int(head["iteration"]), merged, optimizer, steps.pop() if steps else None)
