"""Token-choice routing: which k experts each token goes to, with what weight, and the load-balancing losses.

The router's linear layer (with a bias under model.moe_router_bias, gpt-oss) and everything after it run in
fp32 (a bf16 softmax over many experts ties and flips choices between layouts). Scores are a softmax over all
experts (Mixtral, Qwen3-MoE, gpt-oss) or a sigmoid per expert (DeepSeek-V3). The k best scores are chosen,
optionally only inside the best groups of experts (group-limited routing: a group's score is the sum of its best
model.moe_router_group_experts experts' scores: 2 in the released DeepSeek-V3, Kimi K2 and Moonlight, as transformers
computes them; by default k/group_topk, as Megatron-Core does), and the chosen scores become the combine
weights: renormalised to sum to one when asked (a softmax over the k chosen logits, as Mixtral and gpt-oss
compute it, is exactly this) and scaled.

The balancing losses need the whole micro batch's load, but under sequence or context parallelism each rank
holds part of its tokens. Every rank therefore sums its expert counts over the ranks holding the rest
(`ctx.sequence_ranks`; counts carry no gradient), and each adds only its own tokens' share of the probability sums:
the ranks' terms add up to the one-device loss, and their gradients meet where the router's do (its weight's
gradient is partial over tp under SP, so summed over tp). Over cp the gradients are averaged with the data
(each context-parallel rank's main loss is the mean over its own tokens), so there a term counts cp times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.model.aux_losses import AuxLosses
from megalite.model.costs import MicroBatch, matmul_held
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.expert_parallel import sum_counts

# The balancing terms a router attaches (model/aux_losses.py), by the name they are logged under.
BALANCING_TERMS = ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss")


@dataclass(frozen=True)
class Routing:
    experts: torch.Tensor  # [tokens, k] chosen expert ids
    weights: torch.Tensor  # [tokens, k] fp32 combine weights
    scores: torch.Tensor  # [tokens, experts] fp32 scores (softmax probabilities or sigmoids)


def choose(scores: torch.Tensor, k: int, groups: int = 1, group_topk: int | None = None,
           bias: torch.Tensor | None = None, group_experts: int | None = None) -> torch.Tensor:
    """[tokens, k] ids of the k best experts by `scores` (+ `bias`, which only chooses), within the
    `group_topk` best of `groups` equal groups of experts, a group scored by the sum of its `group_experts` best
    (default k // group_topk)."""
    ranking = scores if bias is None else scores + bias
    if groups > 1 and group_topk is not None and group_topk < groups:
        tokens, experts = ranking.shape
        grouped = ranking.view(tokens, groups, experts // groups)
        group_scores = grouped.topk(group_experts or k // group_topk, dim=-1).values.sum(-1)
        best = group_scores.topk(group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        ranking = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return ranking.topk(k, dim=-1).indices


def route(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None) -> Routing:
    """Scores, choices and combine weights of fp32 router logits [tokens, experts]."""
    scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
    experts = choose(scores, cfg.moe_topk, cfg.moe_router_groups, cfg.moe_router_group_topk, bias,
                     cfg.moe_router_group_experts)
    weights = scores.gather(1, experts)
    if cfg.moe_norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Routing(experts, weights * cfg.moe_scaling_factor, scores)


def capacity(cfg: ModelConfig, tokens: int) -> int:
    """How many (token, choice) pairs each expert keeps of a rank's `tokens` tokens (moe_capacity_factor)."""
    return math.ceil(cfg.moe_capacity_factor * tokens * cfg.moe_topk / cfg.num_experts)


def balance_probabilities(routing: Routing, cfg: ModelConfig) -> torch.Tensor:
    """The per-token expert distribution the balancing losses weigh the load with: the softmax itself, or the
    sigmoid scores normalised to sum to one (DeepSeek-V3)."""
    if cfg.moe_router == "softmax":
        return routing.scores
    return routing.scores / (routing.scores.sum(-1, keepdim=True) + 1e-20)


def balancing_choices(probs: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens, k] the experts whose load the balancing losses count (their f_e): the plain top-k of the
    balancing probabilities, without the expert bias and the group limit that decide where tokens go. This is
    DeepSeek-V3's f_i (its report counts s_i,t in TopK(s), not in TopK(s + b)) and Megatron-Core's (its
    aux-loss routing map is a top-k of the scores alone), so a converted Megatron run takes Megatron's step.
    Without a bias or groups these are the routing's own choices."""
    return probs.detach().topk(k, dim=-1).indices


def expert_counts(experts: torch.Tensor, num_experts: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """How many of the (token, choice) pairs went to each expert: ids [..., tokens, k] -> [..., experts] counts in
    `dtype` (default: the ids'; the balancing losses count in fp32). Not torch.bincount: its output's size depends
    on the largest id, which CUDA reads on the host (a sync per MoE layer) and a fake tensor cannot know (the dry
    run)."""
    flat = experts.flatten(-2)
    counts = flat.new_zeros((*flat.shape[:-1], num_experts), dtype=dtype)
    return counts.scatter_add_(-1, flat, torch.ones_like(flat, dtype=counts.dtype))


def switch_loss(probs: torch.Tensor, counts: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """Switch Transformer's balancing loss E * sum_e f_e P_e over a micro batch of `tokens` tokens: f_e the
    fraction of the k*tokens choices that went to e (`counts`, over the whole micro batch), P_e the mean
    probability of e; `probs` [local tokens, E] adds this rank's tokens' part of P."""
    experts = probs.shape[-1]
    return (probs.sum(0) * counts).sum() * experts / (k * tokens * tokens)


def sequence_loss(probs: torch.Tensor, counts: torch.Tensor, seq: int, k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balancing loss, the switch loss of each sequence, averaged over sequences:
    `probs` [local seq, batch, E], `counts` [batch, E] over each whole sequence of `seq` tokens."""
    experts, batch = probs.shape[-1], probs.shape[1]
    return (probs.sum(0) * counts).sum() * experts / (k * seq * seq * batch)


def z_loss(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """ST-MoE's router z-loss, the mean of logsumexp(logits)^2 over a micro batch of `tokens` tokens; this
    rank's tokens' part."""
    return torch.logsumexp(logits, dim=-1).square().sum() / tokens


class Router(nn.Module):
    """The gate: fp32 logits of every expert for every token, the routing, and the balancing terms attached
    (model/aux_losses.py) to the combine weights the layer goes on computing with."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, aux_losses: AuxLosses, layer: int) -> None:
        """`layer`: the global index of the layer it routes for (its load is logged under it)."""
        super().__init__()
        self.cfg, self.ctx, self.aux_losses, self.layer = cfg, ctx, aux_losses, layer
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.features.moe_router_bias else None
        # State, not a parameter: no gradient, moved by `adjust_bias`; checkpointed; starts at zero (model/init.py).
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts) if cfg.moe_expert_bias else None)

    @torch.no_grad()
    def adjust_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update from the step's tokens per expert over every rank: up for the experts below
        the mean, down for those above."""
        self.expert_bias += self.cfg.moe_bias_update_rate * torch.sign(load.mean() - load)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [seq (local), batch, hidden] -> the routing of its tokens, flattened seq-major."""
        seq, batch, _ = x.shape
        with torch.autocast(x.device.type, enabled=False):
            logits = gemm.linear(x.reshape(-1, x.shape[-1]).float(), self.weight, self.bias)
        routing = route(logits, self.cfg, self.expert_bias)
        if not self.training:
            return routing
        counts = expert_counts(routing.experts, self.cfg.num_experts, torch.float32)
        dropped = None
        if self.cfg.moe_capacity_factor is not None:
            dropped = (counts - counts.clamp(max=capacity(self.cfg, seq * batch))).sum()
        self.aux_losses.record_load(self.layer, counts, dropped)
        weights = self._balancing(routing, logits, seq, batch)
        return Routing(routing.experts, weights, routing.scores)

    def _attach(self, name: str, weights: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return self.aux_losses.attach(name, weights, loss * self.ctx.cp.size)

    def _balancing(self, routing: Routing, logits: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
        cfg, weights = self.cfg, routing.weights
        sharers = self.ctx.sequence_ranks  # ranks holding parts of each sequence of this micro batch
        tokens, k = seq * batch * sharers.size, cfg.moe_topk
        if cfg.moe_aux_loss_coeff or cfg.moe_seq_aux_loss_coeff:
            probs = balance_probabilities(routing, cfg)
            balanced = balancing_choices(probs, k)
        if cfg.moe_aux_loss_coeff:
            counts = sum_counts(expert_counts(balanced, cfg.num_experts, torch.float32), sharers)
            loss = cfg.moe_aux_loss_coeff * switch_loss(probs, counts, tokens, k)
            weights = self._attach(BALANCING_TERMS[0], weights, loss)
        if cfg.moe_seq_aux_loss_coeff:
            per_sequence = balanced.view(seq, batch, k).transpose(0, 1)
            counts = sum_counts(expert_counts(per_sequence, cfg.num_experts, torch.float32), sharers)
            loss = sequence_loss(probs.view(seq, batch, -1), counts, seq * sharers.size, k)
            loss = cfg.moe_seq_aux_loss_coeff * loss
            weights = self._attach(BALANCING_TERMS[1], weights, loss)
        if cfg.moe_z_loss_coeff:
            weights = self._attach(BALANCING_TERMS[2], weights, cfg.moe_z_loss_coeff * z_loss(logits, tokens))
        return weights

    def saved_bytes(self, batch: MicroBatch) -> int:
        """For the rank's routed tokens (its residual rows), in fp32: the input as fp32 (a copy unless the parameters
        are fp32; gemm.py keeps the parameter itself), the scores, the chosen ids (int64), the chosen scores and
        their sums when renormalised, the logits and their logsumexp with the z-loss on."""
        tokens, experts, k = batch.rows, self.cfg.num_experts, self.cfg.moe_topk
        size = tokens * self.weight.shape[1] * 4 + tokens * experts * 4 + tokens * k * 8
        size += tokens * (k + 1) * 4 if self.cfg.moe_norm_topk_prob else 0
        return size + (tokens * (experts + 1) * 4 if self.cfg.moe_z_loss_coeff else 0)

    def held_bytes(self, batch: MicroBatch) -> int:
        return matmul_held(self.weight, batch.rows, 4)  # fp32

    def matmul_parameters(self) -> int:
        return self.weight.numel()
