"""Megatron-LM's `torch_dist` checkpoint format: a torch.distributed.checkpoint directory, read without Megatron.

`.metadata` (a pickle of torch.distributed.checkpoint's dataclasses, read by safe_pickle.py) gives each
tensor's global shape and chunks and where each chunk's bytes lie in the `__*.distcp` files (each chunk a
small torch.save archive). Global tensors are whole: no tensor-parallel merging, and the layers of a
homogeneous decoder stacked on a leading dimension (`decoder.layers.mlp.linear_fc2.weight` [L, ...]); older
Megatron writes `decoder.layers.<i>.` names. Norms use Transformer Engine's names even with the local spec.
Everything else is a bytes entry: the common state (`args`, `iteration`, optimizer param groups) as
`common_state/...` (or, before mid-2026, a `common.pt` file beside), the RNG and rerun states and Transformer
Engine's `_extra_state`, which megalite does not need. Adam's state is per parameter
(`optimizer.state.exp_avg.<param>`; the distributed optimizer's `--dist-ckpt-optim-fully-reshardable` adds its
fp32 main weights as `optimizer.state.param.<param>`), or, the distributed optimizer's default
(`dp_reshardable`), flat over its buckets (`optimizer.distributed.*`, flat_state.py). The weights are read
whatever the optimizer's layout; its entries only when the optimizer state is asked for.
A layer's routed experts are one tensor [layers, experts, ...] per projection (`mlp.experts.experts.*`), the
same for Megatron's local SequentialMLP and Transformer Engine's grouped experts.
"""

from __future__ import annotations

import argparse
import io
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megalite.checkpoint.megatron.flat_state import FLAT, read_dp_reshardable
from megalite.checkpoint.megatron.names import IGNORED_SUFFIX, LAYER
from megalite.checkpoint.megatron.safe_pickle import load_dcp_metadata, load_megatron_pickle
from megalite.checkpoint.megatron.state import MAIN, MegatronState

OPTIMIZER_KINDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": MAIN, "fp32_param": MAIN}
NOT_NEEDED = ("rng_state/", "rerun_state_machine_state/")
STACKED = "decoder.layers."
OPTIMIZER = re.compile(r"(chained_\d+\.)?optimizer\.")


class _Files:
    """The bytes of each stored item, by (name, chunk offsets)."""

    def __init__(self, found: Path, storage: dict) -> None:
        self.found = found
        self.where = {(index.fqn, tuple(index.offset) if index.offset is not None else None): info
                      for index, info in storage.items()}

    def read(self, fqn: str, offset: tuple[int, ...] | None) -> bytes:
        info = self.where.get((fqn, offset))
        if info is None:
            raise ValueError(f"{self.found}/.metadata lists {fqn} at {offset} but no file holds it; "
                             "the checkpoint is incomplete")
        if info.transform_descriptors:
            raise ValueError(f"{self.found}: {fqn} is stored transformed ({info.transform_descriptors}); "
                             "megalite reads plain torch.distributed.checkpoint files only")
        with open(self.found / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return f.read(info.length)

    def tensor(self, fqn: str, meta: TensorStorageMetadata) -> torch.Tensor:
        """The global tensor, assembled from its chunks."""
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            part = torch.load(io.BytesIO(self.read(fqn, tuple(chunk.offsets))), map_location="cpu",
                              weights_only=True)
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
        return out


def _unstack(name: str, tensor: torch.Tensor, meta: TensorStorageMetadata, num_layers: int) -> dict[str, torch.Tensor]:
    """Per-layer tensors of a stacked decoder tensor (the layers some chunk covers: a layer type only some
    layers have, such as experts after dense layers, covers only those); others as they are."""
    if not name.startswith(STACKED) or LAYER.fullmatch(name):
        return {canonical(name): tensor}
    if tensor.shape[0] != num_layers:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}: a stacked layer tensor should have "
                         f"num_layers={num_layers} rows first")
    rest = canonical(name[len(STACKED):])
    layers = sorted({i for c in meta.chunks for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])})
    return {f"{STACKED}{i}.{rest}": tensor[i] for i in layers}


def canonical(name: str) -> str:
    """A tensor's name as names.py knows it: torch_dist's routed experts (`mlp.experts.experts.*`) are the
    layer's stacked experts."""
    return name.replace(".mlp.experts.experts.", ".mlp.experts.", 1).replace("mlp.experts.experts.", "mlp.experts.", 1)


def _common_state(found: Path, files: _Files, names: list[str]) -> dict:
    common = [n for n in names if n.startswith("common_state/")]
    if common:
        state = load_megatron_pickle(files.read(common[0], None), f"{found}: {common[0]}")
    elif (found / "common.pt").is_file():
        state = load_megatron_pickle(found / "common.pt", str(found / "common.pt"))
    else:
        raise FileNotFoundError(f"{found} has neither a common_state entry nor common.pt: no args to build "
                                "the model from")
    return state[0] if isinstance(state, list) else state


def _adam_step(optimizer: dict | None) -> int | None:
    """Adam's step from the common state: a common step (plain optimizer) or in the param groups
    (distributed optimizer)."""
    if not optimizer:
        return None
    if "common_step" in optimizer.get("state", {}):
        return int(optimizer["state"]["common_step"])
    groups = optimizer.get("optimizer", optimizer).get("param_groups", [])
    steps = {int(group["step"]) for group in groups if "step" in group}
    return steps.pop() if len(steps) == 1 else None


def _per_parameter(name: str) -> tuple[str, str]:
    """(kind, parameter name) of an `optimizer.state.<kind>.<param>` entry; other optimizer entries stop."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[1] == "state" and parts[2] in OPTIMIZER_KINDS:
        return OPTIMIZER_KINDS[parts[2]], parts[3]
    raise ValueError(f"optimizer entry {name!r} is not one megalite understands; convert with --no-optimizer to "
                     "carry the weights only")


def _optimizer(found: Path, files: _Files, entries: dict, args: argparse.Namespace,
               weights: dict[str, torch.Tensor], common: dict) -> tuple[dict, int | None]:
    """Adam's state per parameter (`optimizer.state.*`, or the distributed optimizer's flat buckets,
    flat_state.py) and its step."""
    if any(FLAT.fullmatch(name) for name in entries):
        stray = [name for name in entries if not FLAT.fullmatch(name)]
        if stray:
            raise ValueError(f"{found}: optimizer entries {stray[:3]} beside the distributed optimizer's flat "
                             "buckets; convert with --no-optimizer to carry the weights only")
        return read_dp_reshardable(
            entries, lambda name: load_megatron_pickle(files.read(name, None), f"{found}: {name}"),
            lambda name: files.tensor(name, entries[name]), weights, args, str(found))
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for name, item in entries.items():
        if isinstance(item, BytesStorageMetadata):
            raise ValueError(f"{found}: entry {name!r} is not one megalite understands")
        kind, param = _per_parameter(name)
        for layer_param, tensor in _unstack(param, files.tensor(name, item), item, args.num_layers).items():
            optimizer.setdefault(layer_param, {})[kind] = tensor
    return optimizer, _adam_step(common.get("optimizer"))


def read_torch_dist(found: Path, check: Callable[[argparse.Namespace], None], with_optimizer: bool) -> MegatronState:
    """The checkpoint in `found` (its optimizer state only `with_optimizer`); `check` sees its args before the
    tensors are read."""
    meta = load_dcp_metadata(found / ".metadata")
    files = _Files(found, meta.storage_data)
    entries = meta.state_dict_metadata
    common = _common_state(found, files, list(entries))
    args = common["args"]
    check(args)
    weights, optimizer_entries = {}, {}
    for name, item in entries.items():
        if OPTIMIZER.match(name):
            optimizer_entries[name] = item
        elif isinstance(item, BytesStorageMetadata):
            if not (name.startswith(("common_state/", *NOT_NEEDED)) or IGNORED_SUFFIX + "/" in name):
                raise ValueError(f"{found}: entry {name!r} is not one megalite understands")
        else:
            weights |= _unstack(name, files.tensor(name, item), item, args.num_layers)
    optimizer, step = {}, None
    if with_optimizer and optimizer_entries:
        optimizer, step = _optimizer(found, files, optimizer_entries, args, weights, common)
    return MegatronState(found, args, int(common["iteration"]), weights, optimizer, step)
