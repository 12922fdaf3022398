"""DeepSeek-V3's auxiliary-loss-free balancing, after each step: every router's expert bias moves towards the
experts that got fewer tokens, judged from the load counted over every rank. Each MoE layer lives on one
pipeline stage and every rank of that stage routed different tokens (tp under SP, cp, dp), so one all-reduce
over the world of all layers' loads (zeros where a rank holds no such layer) gives each layer its whole step's
load, identical on every rank: the biases stay equal wherever a router is replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.model.gpt import GPTModel
from megalite.model.moe.layer import MoELayer
from megalite.parallel.topology import Topology


def update_expert_biases(model: GPTModel, topology: Topology) -> None:
    cfg = model.cfg
    layers = list(cfg.moe_layers)
    zero = torch.zeros(cfg.num_experts, device=topology.device)
    loads = torch.stack([model.aux_losses.loads.get(layer, zero) for layer in layers])
    if topology.world_size > 1:
        dist.all_reduce(loads)
    for index, layer in model.layers.items():
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.router.adjust_bias(loads[layers.index(int(index))])
