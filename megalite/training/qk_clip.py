"""MuonClip's QK-clip (Kimi K2, `optim.qk_clip_threshold`): after each update, a head whose largest attention
logit of the step exceeded the threshold t has its query and key weights rescaled so that its logits shrink by
gamma = t / max_logit, the other heads' left alone.

Each attention layer tracks its heads' largest logit over the step's forwards and micro batches (model/attention.py
`max_logits`: an extra QK^T pass, as the fused kernel returns no logits); heads are split over tp, so the maxima are
reduced over the data- and context-parallel ranks only, in one all-reduce for every layer of the stage. Under
context parallelism (ring or all-gather) a rank's queries are measured against the whole sequence's keys, gathered
over cp for the measurement: per layer and micro batch one all-gather of k (groups x s x d elements in all, which
ring attention otherwise never holds at once) and an s/cp x s block of scores per head. The split follows Kimi K2
(sqrt(gamma) on q and on k), generalised to grouped-query attention, where a key head serves several query heads:
the shared key head is scaled by sqrt(g), g the smallest gamma of its group, and each query head by gamma / sqrt(g),
so every query head's logits are scaled by exactly its own gamma (1 for heads under the threshold). The scaling
multiplies the owned slices of the fused QKV weight (and its bias) in the optimizer's main weights, before they are
written back and shared, so it holds at every layout. A head with no finite maximum (a NaN forward) is left alone.
Latent attention (model/latent_attention.py) follows Kimi K2's rule for MLA: head h's q_nope rows (its part of the
query up-projection) and k_nope rows (its part of the kv up-projection) are scaled by sqrt(gamma_h), its q_rope rows
by gamma_h; the rotary key (in the kv down-projection) is shared by all heads and left alone, as is v. Its logits
are measured as the layer's softmax sees them (its own scale, YaRN's mscale included). Multi-token prediction's
layers are clipped too and logged after the main ones (`layer_<num_layers + depth>`).
`last` keeps each head's reduced maximum of the last step; each layer's largest logit since the last log step is
logged as `max_logit/layer_i` (`read`: one all-reduce, one host read, at log steps only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.model.attention import SelfAttention
from megalite.model.gpt import TransformerLayer
from megalite.model.latent_attention import LatentAttention
from megalite.parallel.distributed_optimizer import DistributedOptimizer
from megalite.parallel.topology import Topology


class QKClip:
    def __init__(self, model: nn.Module, optimizer: DistributedOptimizer, topology: Topology, threshold: float,
                 num_layers: int) -> None:
        """`num_layers`: every transformer layer of the model, multi-token prediction's included."""
        self.threshold, self.topology = threshold, topology
        layers = {name: m for name, m in model.named_modules() if isinstance(m, TransformerLayer)}
        self.layers = {f"{name}.attention": m.attention for name, m in layers.items()}
        shards = list({(m.name, m.start): m for m in optimizer.shards()}.values())
        self.targets = {name: [(m, projection) for projection in _projections(attention) for m in shards
                               if m.name.startswith(f"{name}.{projection}.")]
                        for name, attention in self.layers.items()}
        self.last: torch.Tensor | None = None
        self.index = torch.tensor([m.index for m in layers.values()], dtype=torch.long, device=topology.device)
        self.peak = torch.full((num_layers,), float("-inf"), device=topology.device)
        self.reset()

    def reset(self) -> None:
        for attention in self.layers.values():
            attention.max_logits = torch.full((attention.heads,), float("-inf"), device=self.topology.device)

    @torch.no_grad()
    def apply(self) -> None:
        """Rescale the query and key rows of every head over the threshold (after the update, before write-back)."""
        if not self.layers:
            return
        maxima = torch.stack([a.max_logits for a in self.layers.values()])
        if self.topology.dp_cp > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.topology.dp_cp_group)
        self.last = maxima
        self.peak[self.index] = torch.maximum(self.peak[self.index], maxima.amax(dim=1))
        gamma = (self.threshold / maxima).clamp(max=1.0)
        gamma = torch.where(torch.isfinite(gamma) & (gamma > 0), gamma, torch.ones_like(gamma))
        for (name, attention), layer_gamma in zip(self.layers.items(), gamma):
            rows = _row_factors(attention, layer_gamma)
            for m, projection in self.targets[name]:
                width = m.param.shape[1] if m.param.ndim == 2 else 1
                index = torch.arange(m.start, m.end, device=layer_gamma.device) // width
                m.main.mul_(rows[projection][index].to(m.main.device, m.main.dtype))
        self.reset()

    def read(self) -> dict[str, float]:
        """Each layer's largest logit since the last read (every rank calls it: the layers live on all stages)."""
        peak, self.peak = self.peak, torch.full_like(self.peak, float("-inf"))
        if self.topology.world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {f"max_logit/layer_{i}": value for i, value in enumerate(peak.tolist()) if value != float("-inf")}


def _projections(attention: SelfAttention | LatentAttention) -> tuple[str, ...]:
    """The projections whose rows QK-clip scales: the fused QKV, or latent attention's query and kv up-projections."""
    if isinstance(attention, LatentAttention):
        return attention.query_projection(), "linear_kv_up_proj"
    return ("linear_qkv",)


def _row_factors(attention: SelfAttention | LatentAttention, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
    """One factor per local row of each projection `_projections` names, from each local head's gamma."""
    if isinstance(attention, LatentAttention):
        root, ones = gamma.sqrt()[:, None], torch.ones_like(gamma)[:, None]
        query = torch.cat((root.expand(-1, attention.nope), gamma[:, None].expand(-1, attention.rope_dim)), dim=1)
        kv = torch.cat((root.expand(-1, attention.nope), ones.expand(-1, attention.v_dim)), dim=1)
        return {attention.query_projection(): query.reshape(-1), "linear_kv_up_proj": kv.reshape(-1)}
    groups, per_group = attention.groups, attention.heads // attention.groups
    gamma = gamma.view(groups, per_group)
    key = gamma.amin(dim=1, keepdim=True).sqrt()
    factors = torch.cat((gamma / key, key, torch.ones_like(key)), dim=1)  # [groups, per_group + 2]
    return {"linear_qkv": factors.repeat_interleave(attention.head_dim, dim=1).reshape(-1)}
