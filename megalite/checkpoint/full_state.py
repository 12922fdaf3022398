"""Model and optimizer state as full (unsharded) tensors named by parameter.

Saving gathers each tensor-parallel shard into the full tensor and, with the distributed
optimizer, assembles each parameter's optimizer state from the data-parallel ranks that own
its slices; loading slices out what this rank holds. A checkpoint therefore does not depend on
the layout it was written with, and optimizer state is stored by parameter name
(safetensors + JSON) rather than by position in a pickled dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.layers import TPContext, parameter_shards, shard, unshard
from megalite.parallel.topology import Topology

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")  # torch AdamW's per-parameter state
MAIN = "main_param"  # the fp32 main weights of bf16/fp16 parameters, stored with the optimizer state


class FullState:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, tp: TPContext, topology: Topology,
                 stepped: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """`stepped` pairs each model parameter with the tensor the optimizer steps for it (itself, or a
        flat slice of it with `owner_range` under the distributed optimizer)."""
        self.model, self.optimizer, self.tp, self.topology, self.stepped = model, optimizer, tp, topology, stepped
        self.shards = parameter_shards(model)
        self.params = dict(model.named_parameters())
        names = {id(p): n for n, p in self.params.items()}
        owner = {id(main): names[id(param)] for param, main in stepped}
        self.order = [owner[id(p)] for group in optimizer.param_groups for p in group["params"]]
        self.mains = [p for group in optimizer.param_groups for p in group["params"]]
        self.keys = STATE_KEYS + ((MAIN,) if any(param.dtype != main.dtype for param, main in stepped) else ())
        self.ranges = [getattr(p, "owner_range", None) for group in optimizer.param_groups for p in group["params"]]
        self.distributed = any(r is not None for r in self.ranges)
        self.aliases = model.aliases() if hasattr(model, "aliases") else {}

    @property
    def every_rank_gathers(self) -> bool:
        """Whether all data-parallel ranks must take part in gathering (their optimizer shards differ)."""
        return self.distributed

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

    def _local_state(self, name: str, key: str, state: dict) -> torch.Tensor:
        """This rank's (tensor-parallel shard of the) optimizer state `key` of parameter `name`."""
        param = self.params[name]
        indices = [i for i, n in enumerate(self.order) if n == name]
        if not self.distributed:
            entry = state.get(indices[0], {}) if indices else {}
            if key not in entry:  # no step taken yet (e.g. every fp16 step so far overflowed)
                return torch.zeros(()) if key == "step" else torch.zeros_like(param)
            return entry[key] if torch.is_tensor(entry[key]) else torch.tensor(entry[key])
        if key == "step":
            value = max((float(state[i]["step"]) for i in indices if i in state), default=0.0)
            flat = torch.tensor([value], device=param.device)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.topology.dp_group)
            return flat[0]
        flat = torch.zeros(param.numel(), device=param.device)
        for i in indices:
            lo, hi = self.ranges[i]
            if i in state:
                flat[lo:hi] = state[i][key]
        dist.all_reduce(flat, group=self.topology.dp_group)
        return flat.view_as(param)

    def optimizer_tensors(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """(tensors named '<param>/<state key>', param-group hyperparameters). Collective over TP
        (and over DP with the distributed optimizer)."""
        state = self.optimizer.state_dict()
        if MAIN in self.keys:
            state["state"] = {i: {**state["state"].get(i, {}), MAIN: main.detach()} for i, main in enumerate(self.mains)}
        tensors = {}
        for name in self.params:
            if name not in self.aliases:
                for key in self.keys:
                    tensors[f"{name}/{key}"] = self._gather(name, self._local_state(name, key, state["state"]))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        return tensors, groups

    def load_model(self, full: dict[str, torch.Tensor]) -> None:
        """Load this rank's slices from full tensors (which may hold other stages' tensors too)."""
        device = next(iter(self.params.values())).device
        local = {name: self._slice(name, full[self.aliases.get(name, name)]).to(device) for name in self.model.state_dict()}
        self.model.load_state_dict(local)
        for param, main in self.stepped:  # fp32 main copies start from the loaded weights (load_optimizer may refine them)
            if main.dtype != param.dtype:
                lo, hi = getattr(main, "owner_range", None) or (0, param.numel())
                main.data.copy_(param.data.reshape(-1)[lo:hi].view_as(main))

    def load_optimizer(self, tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> None:
        current = self.optimizer.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, name in enumerate(self.order):
            stored = self.aliases.get(name, name)
            for key in self.keys:
                if key == MAIN and f"{stored}/{key}" not in tensors:  # saved from fp32 parameters: the model weights are the main weights
                    continue
                value = self._slice(name, tensors[f"{stored}/{key}"])
                if self.ranges[index] is not None and key != "step":
                    lo, hi = self.ranges[index]
                    value = value.reshape(-1)[lo:hi]
                if key == MAIN:
                    self.mains[index].data.copy_(value.view_as(self.mains[index]))
                else:
                    state.setdefault(index, {})[key] = value
        merged = [{**saved, "params": now["params"]} for saved, now in zip(groups, current["param_groups"])]
        self.optimizer.load_state_dict({"state": state, "param_groups": merged})
