"""The optimizer over fp32 main parameters, sharded over data-parallel ranks or not.

AdamW steps fp32 "main" tensors (`MainParam`): with the distributed optimizer (ZeRO-1) only
the flat slices of each parameter this data-parallel rank owns in its gradient buffer's
layout (grad_buffer.py), afterwards all-gathered into every replica's parameters; without
it, whole parameters. Parameters kept in bf16/fp16 (`train.param_dtype`) get fp32 copies as
main tensors, written back after each step so small updates are not lost to rounding
(Megatron-LM's --bf16); fp32 ones are stepped in place.

The global gradient norm counts each element once: tensor-parallel shards on every rank,
replicated parameters on TP rank 0, tied copies never, each data-parallel slice on its owner.

With `parallel.overlap_param_gather` the all-gathers stay in flight after the step, launched
in forward order; a forward pre-hook on each module waits only for the buckets holding its
own parameters, and direct weight reads elsewhere call `wait_for`.

The update is torch's fused AdamW, one multi-tensor kernel on CPU and CUDA alike. It is the
upstreamed form of NVIDIA apex's FusedAdam (pytorch/pytorch#71274), so megalite does not use
apex's: apex kept Adam's step in the param groups, where checkpoints did not find it, and a
resume silently restarted Adam's moments. One optimizer means one checkpoint format.

With `optim.offload=cpu` (ZeRO-Offload, Megatron-LM's --optimizer-cpu-offload) the fp32 main
weights and Adam's state live in (pinned) host memory and the update runs there, on torch's fused
CPU AdamW. The reduced gradient slices of each bucket are copied to the host as soon as that bucket's
reduction has landed (while later buckets' reductions are still landing), and after the update each
bucket's weights go back before that bucket's parameter all-gather, so copies overlap communication;
all copies are non-blocking, with one synchronisation before the update. Device memory then holds
no fp32 state at all, at the price of those two copies and a CPU update.

ZeRO-2 (gradients sharded) lives in the gradient buffers (grad_buffer.py). Under ZeRO-3 (parameters
sharded too) the owned slices are this rank's parameter shard itself: the step updates it and
nothing is gathered afterwards, the next forward gathers each layer when it needs it (zero3.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimConfig
from megalite.parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel.layers import parameter_shards
from megalite.parallel.mappings import all_gather_single
from megalite.parallel.topology import Topology, synchronize


@dataclass
class MainParam:
    """Elements [start, end) of `param` (flattened), stepped as the fp32 tensor `main` with the
    gradient view `grad`; `weights` is where those elements are stored (a view of the parameter, or
    under ZeRO-3 of this rank's parameter shard). `main` shares that storage when the parameter is fp32."""

    name: str
    param: nn.Parameter
    main: torch.Tensor
    grad: torch.Tensor
    weights: torch.Tensor
    start: int
    end: int

    @property
    def is_copy(self) -> bool:
        """Whether `main` is a copy to write back into the weights (bf16/fp16 parameters, or offloaded)."""
        return self.weights.untyped_storage().data_ptr() != self.main.untyped_storage().data_ptr()


def _host_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An fp32 copy of `tensor` in host memory, pinned when the device is a GPU (so copies overlap)."""
    host = tensor.detach().to("cpu", torch.float32, copy=True)
    return host.pin_memory() if device.type == "cuda" else host


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


class DistributedOptimizer:
    """`buffers`: the gradient buffers of data parallelism (ddp.py), whose layout decides each rank's
    slices. `tied_copies`: names of parameters that copy another (left out of the norm)."""

    def __init__(self, model: nn.Module, buffers: list[GradBuffer], topology: Topology, cfg: OptimConfig,
                 distributed: bool, overlap_param_gather: bool, tied_copies: set[str] = frozenset()) -> None:
        self.topology, self.buffers, self.distributed = topology, buffers, distributed
        self.offload = cfg.offload == "cpu"
        names = {id(p): n for n, p in model.named_parameters()}
        owned = [(buffer, param, lo, hi) for buffer in buffers for param, lo, hi in buffer.owned_ranges()]
        self.params = [self._main_param(names[id(param)], param, buffer, lo, hi) for buffer, param, lo, hi in owned]
        shards = parameter_shards(model)
        self._counted = [m for m in self.params
                         if m.name not in tied_copies and (m.name in shards or topology.tp_rank == 0)]
        self._in_bucket: dict[int, list[MainParam]] = {}
        for (buffer, param, _, _), m in zip(owned, self.params):
            self._in_bucket.setdefault(id(buffer.bucket_of[id(param)]), []).append(m)
        self._host_grads = {id(m): _host_copy(m.main, topology.device) for m in self.params} if self.offload else {}
        self._copies = [(m.weights.view_as(m.main), m.main) for m in self.params if m.is_copy]
        self.optimizer = adamw(decay_groups(((m.name, m.param, m.main) for m in self.params), cfg.weight_decay), cfg)
        self._gathers: dict[int, dist.Work] = {}
        self._found_inf: torch.Tensor | None = None
        self.gather_in_background = distributed and overlap_param_gather and not any(b.shard_params for b in buffers)
        if self.gather_in_background:
            self._wait_before_use(model)

    def _main_param(self, name: str, param: nn.Parameter, buffer: GradBuffer, lo: int, hi: int) -> MainParam:
        grad = buffer.owned_grad(param, lo, hi) if self.distributed else param.main_grad
        weights = buffer.owned_weights(param, lo, hi) if self.distributed else param.data
        if self.offload:
            main = nn.Parameter(_host_copy(weights, self.topology.device), requires_grad=False)
        elif param.dtype != torch.float32:
            main = nn.Parameter(weights.float(), requires_grad=False)
        else:  # stepped in place
            main = nn.Parameter(weights, requires_grad=False) if self.distributed else param
        return MainParam(name, param, main, grad, weights.view(-1), lo, hi)

    def host_grads(self) -> list[torch.Tensor]:
        """The host buffers offloaded gradients are copied into (none without offload)."""
        return list(self._host_grads.values())

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
        """The bucket's reduced gradients are final: offloaded, start their copies to the host now, while
        later buckets' reductions are still landing (non-blocking, so they queue behind the reduction)."""
        for m in self._in_bucket.get(id(bucket), []) if self.offload else []:
            self._grad_to_host(m)

    def _grad_to_host(self, m: MainParam) -> None:
        m.main.grad = self._host_grads[id(m)].copy_(m.grad.view_as(m.main), non_blocking=True)

    def collect_grads(self) -> None:
        """Point each main tensor at its (reduced) gradient, in fp32: on the host when offloaded (copies
        `grads_landed` has not started yet are started here)."""
        if self.offload:
            for m in self.params:
                if m.main.grad is None:
                    self._grad_to_host(m)
            synchronize(self.topology.device)
            return
        for m in self.params:
            m.main.grad = m.grad if m.grad.dtype == m.main.dtype else m.grad.to(m.main.dtype)

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
        group = dist.group.WORLD if self.distributed else t.mp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
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
        self.finish_step()

    def finish_step(self) -> None:
        """Write fp32 main weights back into bf16/fp16 parameters and share updated slices (distributed
        optimizer); drop .grad so the next backward starts clean. Also after a skipped step."""
        if self._copies and not self.offload:
            torch._foreach_copy_([weights for weights, _ in self._copies], [main for _, main in self._copies])
        self._write_back_and_gather(self.offload, background=self.gather_in_background)
        for m in self.params:
            m.param.grad = m.main.grad = None

    def gather_params(self) -> None:
        """Every parameter whole again from the ranks that own its slices (distributed optimizer), e.g.
        after a resume that loaded only this rank's slices."""
        self._write_back_and_gather(False, background=False)

    def _write_back_and_gather(self, from_host: bool, background: bool) -> None:
        """Bucket by bucket, first-used first: copy the bucket's updated host main weights into the weights
        (`from_host`, offloaded: non-blocking), then all-gather its updated slices (stages 1-2), so one
        bucket's gather overlaps the next one's copy. `background` leaves the gathers in flight for
        `wait_for` / `wait_params`. ZeRO-3 gathers nothing here: each forward gathers what it uses."""
        for buffer in self.buffers:
            for bucket in reversed(buffer.buckets):
                for m in self._in_bucket.get(id(bucket), []) if from_host else []:
                    m.weights.view_as(m.main).copy_(m.main, non_blocking=True)
                if self.distributed and buffer.dp > 1 and not buffer.shard_params:
                    a, b = bucket.shard(buffer.dp_rank, buffer.dp)
                    whole = buffer.param_data[bucket.start:bucket.end]
                    shard = buffer.param_data[a:b].clone()
                    self._gathers[id(bucket)] = all_gather_single(whole, shard, buffer.dp_group, async_op=True)
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
