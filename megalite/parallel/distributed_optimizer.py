"""The optimizer: ownership, the gradient norm, clipping, the update and sharing the result.

AdamW steps fp32 main weights (main_weights.py: in place, a device copy or a host copy) of the ranges
this rank owns: with the distributed optimizer (ZeRO-1 and up) each data-parallel rank owns its shard of
every bucket (bucket_layout.py), and the updated slices are then all-gathered bucket by bucket by the ZeRO
stage's strategy (zero/); without it, whole parameters.

The global gradient norm counts each element once, as its placement says (placement.py `counted`:
the first rank along every axis it is replicated over, each data-parallel slice on its owner, tied
copies never), in one sum over the world.

With `parallel.overlap_param_gather` the all-gathers stay in flight after the step, launched
in forward order; a forward pre-hook on each module waits only for the buckets holding its
own parameters, and direct weight reads elsewhere call `wait_for`. Under ZeRO-3 nothing is gathered
after the step: the next forward gathers each layer when it needs it (zero/stage3.py).

The update is torch's fused AdamW, one multi-tensor kernel on CPU and CUDA alike. It is the
upstreamed form of NVIDIA apex's FusedAdam (pytorch/pytorch#71274), so megalite does not use
apex's: apex kept Adam's step in the param groups, where checkpoints did not find it, and a
resume silently restarted Adam's moments. One optimizer means one checkpoint format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimConfig
from megalite.parallel.bucket_layout import Bucket
from megalite.parallel.grad_buffer import GradBuffer
from megalite.parallel.main_weights import MainParam, MainWeights, Owned
from megalite.parallel.muon import MuonAdamW
from megalite.parallel.muon_plan import MuonPlan, owned_by_index
from megalite.parallel.placement import Placement
from megalite.parallel.topology import Topology


def decay_groups(entries: Iterable[tuple[str, torch.Tensor, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Optimizer groups from (name, model parameter, tensor to step): no weight decay on biases and
    norm weights (decided on the model parameter, whatever slice of it is stepped)."""
    decay, no_decay = [], []
    for name, param, stepped in entries:
        (no_decay if param.ndim < 2 or name.endswith("bias") else decay).append(stepped)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch's fused AdamW over `groups` (see decay_groups)."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)


def _owned_by_index(buffers: list[GradBuffer], names: dict[int, str],
                    placements: dict[str, Placement]) -> dict[str, list[dict[str, tuple[int, int]]]]:
    """muon_plan.owned_by_index of the gradient buffers' layouts."""
    return owned_by_index([(placements[names[id(b.layout.buckets[0].params[0])]].grid, b.layout,
                            b.strategy.sharded_optimizer) for b in buffers], names)


class DistributedOptimizer:
    """`buffers`: the gradient buffers of data parallelism (ddp.py), whose layouts decide each rank's
    slices; `placements`: where each parameter lives (by name), which decides what the norm counts."""

    def __init__(self, model: nn.Module, buffers: list[GradBuffer], topology: Topology, cfg: OptimConfig,
                 distributed: bool, overlap_param_gather: bool, placements: dict[str, Placement],
                 matrices: frozenset[str] = frozenset(), ns_dtype: torch.dtype = torch.bfloat16) -> None:
        """`matrices`: the names of the hidden weight matrices Muon steps (optim.optimizer=muon), `ns_dtype` the
        precision of its Newton-Schulz iteration."""
        self.topology, self.buffers, self.distributed = topology, buffers, distributed
        names = {id(p): n for n, p in model.named_parameters()}
        owned = [[Owned(names[id(param)], param, buffer.owned_weights(param, lo, hi), buffer.owned_grad(param, lo, hi),
                        lo, hi, buffer.bucket_of[id(param)]) for param, lo, hi in buffer.owned_ranges()]
                 for buffer in buffers]
        self.main = MainWeights(owned, topology.device, cfg.offload == "cpu")
        self.params = self.main.params
        self._counted = [m for m in self.params if placements[m.name].counted(
            topology.axes(placements[m.name].grid), distributed, topology.placement_coord(placements[m.name].grid))]
        muon = {m.name: m.main for m in self.params if m.name in matrices} if cfg.optimizer == "muon" else {}
        self.optimizer = adamw(decay_groups(((m.name, m.param, m.main) for m in self.params if m.name not in muon),
                                            cfg.weight_decay), cfg)
        if cfg.optimizer == "muon":
            plan = MuonPlan([(n, p, placements[n]) for n, p in model.named_parameters() if n in matrices],
                            topology.grids, topology.rank, _owned_by_index(buffers, names, placements), distributed)
            self.optimizer = MuonAdamW(self.optimizer, muon, plan, cfg.lr, cfg.weight_decay, cfg.muon_momentum,
                                       cfg.muon_ns_steps, cfg.muon_scale, cfg.muon_split_heads, ns_dtype,
                                       topology.device)
        self._gathers: dict[int, dist.Work] = {}
        self._found_inf: torch.Tensor | None = None
        self.after_update: Callable[[], None] | None = None  # changes the main weights before they are shared
        self.gather_in_background = overlap_param_gather and any(b.strategy.gathers_after_step for b in buffers)
        if self.gather_in_background:
            self._wait_before_use(model)

    def host_grads(self) -> list[torch.Tensor]:
        """The host buffers offloaded gradients are copied into (none without offload)."""
        return self.main.host_grads()

    def on_host(self) -> contextlib.AbstractContextManager:
        """Around unscaling, clipping and the update: offloaded, they run on the host's share of cores."""
        return self.main.on_host()

    def shards(self) -> list[MainParam]:
        """What this rank steps, for checkpoints: each parameter's owned range and its fp32 tensor."""
        return self.params

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def grads_landed(self, bucket: Bucket) -> None:
        """The bucket's reduced gradients are final (offloaded: their copies to the host start now)."""
        self.main.grads_landed(bucket)

    def collect_grads(self) -> None:
        """Point each main tensor at its (reduced) gradient, in fp32 (on the host when offloaded)."""
        self.main.collect_grads()

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer uses."""
        return [m.main.grad for m in self.params]

    def any_overflow(self, found: bool) -> bool:
        """Whether any rank found inf/nan, so all ranks skip the same steps."""
        return bool(self.topology.max_over_ranks([float(found)])[0])

    def norm(self) -> torch.Tensor:
        """The global gradient norm, as a one-element tensor on the device."""
        t = self.topology
        counted = [m.main.grad for m in self._counted]
        zero = torch.zeros((), device=t.device)
        total = (torch.stack(torch._foreach_norm(counted)).float().pow(2).sum() if counted else zero).reshape(1)
        total = total.to(t.device)  # offloaded gradients are on the host; NCCL reduces device tensors
        if t.world_size > 1:
            dist.all_reduce(total)
        return total.sqrt()

    def clip(self, max_norm: float, grad_scale: torch.Tensor) -> torch.Tensor:
        """Multiply the gradients by `grad_scale` (a one-element tensor), scaled down further so the global
        norm is at most max_norm (0 disables), in one pass, all on the device; returns the norm before
        clipping (a device tensor: reading it waits for the GPU). A NaN/Inf norm leaves the gradients as
        they are and makes the next `step` skip the update."""
        norm = (self.norm() * grad_scale).reshape(())
        finite = torch.isfinite(norm)
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
        factor = torch.where(finite, factor, torch.ones_like(norm))
        grads = self.grads()
        if grads:
            torch._foreach_mul_(grads, (grad_scale * factor).to(grads[0].device))
        self._found_inf = (~finite).float()
        return norm

    def step(self) -> None:
        """Update the main parameters, then the model's (`finish_step`). After a non-finite gradient norm
        (`clip`) the fused AdamW kernel leaves weights, moments and step count as they were."""
        if self._found_inf is not None:
            self.optimizer.found_inf = self._found_inf.to(self.params[0].main.device) if self.params else None
        self.optimizer.step()
        self.optimizer.found_inf, self._found_inf = None, None
        if self.after_update is not None:
            self.after_update()
        self.finish_step()

    def finish_step(self) -> None:
        """Write fp32 main weights back into bf16/fp16 parameters and share updated slices (distributed
        optimizer); drop .grad so the next backward starts clean. Also after a skipped step."""
        self.main.write_back()
        self._write_back_and_gather(background=self.gather_in_background)
        for m in self.params:
            m.param.grad = m.main.grad = None

    def gather_params(self) -> None:
        """Every parameter whole again from the ranks that own its slices (distributed optimizer), e.g.
        after a resume that loaded only this rank's slices."""
        self._write_back_and_gather(background=False)

    def _write_back_and_gather(self, background: bool) -> None:
        """Bucket by bucket, first-used first: copy the bucket's updated host main weights into the weights
        (offloaded: non-blocking), then start its all-gather (stages 1-2), so one bucket's gather overlaps
        the next one's copy. `background` leaves the gathers in flight for `wait_for` / `wait_params`."""
        for buffer in self.buffers:
            for bucket in reversed(buffer.buckets):
                self.main.write_back(bucket)
                work = buffer.strategy.gather_params(bucket)
                if work is not None:
                    self._gathers[id(bucket)] = work
        if not background:
            self.wait_params()

    def _wait_before_use(self, model: nn.Module) -> None:
        """Forward pre-hooks that wait for the in-flight gathers of a module's own parameters."""
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if params:
                module.register_forward_pre_hook(lambda _module, _args, params=params: self.wait_for(params))

    def wait_for(self, params: list[nn.Parameter]) -> None:
        """Block until the gathers that update `params` are done (no-op when none is in flight)."""
        if self._gathers:
            self._wait(buffer.bucket_of[id(p)] for buffer in self.buffers for p in params if id(p) in buffer.bucket_of)

    def wait_params(self) -> None:
        """Every parameter up to date: before evaluating or saving outside a training step."""
        self._wait(bucket for buffer in self.buffers for bucket in buffer.buckets)

    def _wait(self, buckets: Iterable[Bucket]) -> None:
        for bucket in buckets:
            work = self._gathers.pop(id(bucket), None)
            if work is not None:
                work.wait()
