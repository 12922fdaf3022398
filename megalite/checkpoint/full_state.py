"""Model and optimizer state as full (unsharded) tensors named by parameter.

Saving gathers each tensor-parallel shard into the full tensor; loading slices out this
rank's shard. A checkpoint therefore does not depend on the tensor-parallel size it was
written with, and optimizer state is stored by parameter name (safetensors + JSON) rather
than by position in a pickled dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.layers import TPContext, parameter_shards, shard, unshard


class FullState:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, tp: TPContext) -> None:
        self.model, self.optimizer, self.tp = model, optimizer, tp
        self.shards = parameter_shards(model)
        self.params = dict(model.named_parameters())
        self.order = [self._name(p) for group in optimizer.param_groups for p in group["params"]]
        self.aliases = model.aliases() if hasattr(model, "aliases") else {}

    def _name(self, param: nn.Parameter) -> str:
        return next(n for n, p in self.params.items() if p is param)

    def _gather(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        spec = self.shards.get(name)
        if spec is None or self.tp.size == 1 or tensor.shape != self.params[name].shape:
            return tensor.detach().cpu()
        parts = [torch.empty_like(tensor) for _ in range(self.tp.size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=self.tp.group)
        return unshard(parts, spec).cpu()

    def _slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        spec = self.shards.get(name)
        if spec is None or full.ndim == 0:
            return full
        return shard(full, spec, self.tp.rank, self.tp.size)

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors, full, by one-device name (copies of other parameters left out).
        Collective over the TP group: every rank must call it."""
        return {name: self._gather(name, t) for name, t in self.model.state_dict().items() if name not in self.aliases}

    def optimizer_tensors(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """(tensors named '<param>/<state key>', param-group hyperparameters). Collective over TP."""
        state = self.optimizer.state_dict()
        tensors = {}
        for index, entry in state["state"].items():
            name = self.order[index]
            if name in self.aliases:
                continue
            for key, value in entry.items():
                tensors[f"{name}/{key}"] = self._gather(name, value if torch.is_tensor(value) else torch.tensor(value))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        return tensors, groups

    def model_tensors_shapes(self) -> dict[str, torch.Size]:
        """Full shapes of the tensors this rank loads, by the name they are stored under."""
        shapes = {}
        for local_name, t in self.model.state_dict().items():
            name = self.aliases.get(local_name, local_name)
            spec, shape = self.shards.get(local_name), list(t.shape)
            if spec is not None:
                shape[spec.dim] *= self.tp.size
            shapes[name] = torch.Size(shape)
        return shapes

    def load_model(self, full: dict[str, torch.Tensor]) -> None:
        """Load this rank's slices from full tensors (which may hold other stages' tensors too)."""
        device = next(iter(self.params.values())).device
        local = {name: self._slice(name, full[self.aliases.get(name, name)]).to(device) for name in self.model.state_dict()}
        self.model.load_state_dict(local)

    def load_optimizer(self, tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> None:
        current = self.optimizer.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, name in enumerate(self.order):
            prefix = f"{self.aliases.get(name, name)}/"
            for key, full in tensors.items():
                if key.startswith(prefix):
                    state.setdefault(index, {})[key[len(prefix):]] = self._slice(name, full)
        merged = [{**saved, "params": now["params"]} for saved, now in zip(groups, current["param_groups"])]
        self.optimizer.load_state_dict({"state": state, "param_groups": merged})
