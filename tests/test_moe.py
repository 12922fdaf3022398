"""Mixture of experts on one device: routers and balancing losses against hand-computed values, the grouped GEMM
against a per-expert loop, the whole layer against a loop over tokens and experts, and the config's checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from megalite.config import ConfigError, ModelConfig
from megalite.config_validation import validate
from megalite.model.gpt import GPTModel
from megalite.model.moe.dispatch import Sorted
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.router import (
    capacity,
    choose,
    expert_counts,
    route,
    sequence_loss,
    switch_loss,
    z_loss,
)
from megalite.model.recompute import apply_recompute
from megalite.parallel.context import AxisView, ParallelContext
from megalite.parallel.gemm import grouped_kernel_takes, grouped_linear
from megalite.planning.measure import saved_storages


def moe_config(**fields) -> ModelConfig:
    base = dict(family="llama", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                num_experts=4, moe_topk=2, moe_ffn_hidden_size=16)
    return ModelConfig(**{**base, **fields})


LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])


def test_softmax_router_renormalised_is_mixtrals_softmax_over_the_chosen_logits():
    routing = route(LOGITS, moe_config())
    assert routing.experts.tolist() == [[0, 1], [1, 3]]
    mixtral = torch.stack([LOGITS[0, [0, 1]], LOGITS[1, [1, 3]]]).softmax(-1)
    torch.testing.assert_close(routing.weights, mixtral)


def test_softmax_router_without_renormalising_keeps_the_probabilities():
    """Qwen3-MoE with norm_topk_prob=false (Qwen2-MoE): the chosen experts' share of the softmax over all."""
    routing = route(LOGITS, moe_config(moe_norm_topk_prob=False))
    e = [math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)]
    assert routing.weights[0].tolist() == pytest.approx([e[0] / sum(e), e[1] / sum(e)])


def test_sigmoid_router_normalises_and_scales():
    routing = route(LOGITS, moe_config(moe_router="sigmoid", moe_scaling_factor=2.5))
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    assert routing.experts[1].tolist() == [1, 3]
    assert routing.weights[1].tolist() == pytest.approx((2.5 * s / s.sum()).tolist())


def test_group_limited_routing_chooses_only_inside_the_best_groups():
    """Groups {0,1} and {2,3}; k=2 over one group: each group scores its best expert. Token 0's best group is
    {0,1}, though expert 2 alone outscores expert 1."""
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.4]])
    assert choose(scores, 2).tolist() == [[0, 2]]
    assert choose(scores, 2, groups=2, group_topk=1).tolist() == [[0, 1]]


def test_the_expert_bias_chooses_but_never_weighs():
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # pushes expert 2 into every token's choice
    plain, biased = route(LOGITS, moe_config()), route(LOGITS, moe_config(), bias)
    assert biased.experts.tolist() == [[2, 0], [2, 1]]
    chosen = LOGITS.softmax(-1).gather(1, biased.experts)
    torch.testing.assert_close(biased.weights, chosen / chosen.sum(-1, keepdim=True))
    assert not torch.equal(plain.experts, biased.experts)


def test_the_bias_moves_towards_the_experts_below_the_mean_load():
    model = GPTModel(moe_config(moe_expert_bias=True, moe_bias_update_rate=0.1), torch.device("cpu"), seed=0)
    router = model.layers["0"].mlp.router
    assert router.expert_bias.tolist() == [0.0] * 4 and "layers.0.mlp.router.expert_bias" in model.state_dict()
    router.adjust_bias(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])


def test_switch_loss_is_one_coefficient_at_perfect_balance_and_by_hand_otherwise():
    probs = torch.full((4, 4), 0.25)
    counts = torch.full((4,), 2.0)  # 4 tokens x 2 choices spread evenly
    assert switch_loss(probs, counts, tokens=4, k=2).item() == pytest.approx(1.0)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]])
    counts = expert_counts(torch.tensor([[0, 1], [0, 1]]), 4)
    # E * sum_e f_e P_e with f = counts / (k T) = [.5, .5, 0, 0], P = mean probs = [.55, .25, .1, .1]
    assert switch_loss(probs, counts, tokens=2, k=2).item() == pytest.approx(4 * (0.5 * 0.55 + 0.5 * 0.25))


def test_sequence_loss_averages_each_sequences_switch_loss():
    probs = torch.tensor([[[0.7, 0.3], [0.5, 0.5]], [[0.1, 0.9], [0.5, 0.5]]])  # [seq 2, batch 2, experts 2]
    experts = torch.tensor([[[0], [1]], [[0], [0]]])  # [batch, seq, k=1]
    counts = expert_counts(experts, 2)
    per_sequence = [switch_loss(probs[:, b], counts[b], tokens=2, k=1) for b in range(2)]
    assert sequence_loss(probs, counts, seq=2, k=1).item() == pytest.approx(sum(per_sequence).item() / 2)


def test_z_loss_is_the_mean_squared_logsumexp():
    expected = (torch.logsumexp(LOGITS, -1) ** 2).mean()
    assert z_loss(LOGITS, tokens=2).item() == pytest.approx(expected.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_loop_over_experts(dtype):
    """Uneven groups, one of them empty, forward and backward."""
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 8, 16, requires_grad=True)
    y = grouped_linear(x, w, counts.cumsum(0).to(torch.int32))
    y.sum().backward()  # an expanded gradient: the grouped GEMM's backward needs it made contiguous
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loop = torch.cat([F.linear(part, wr[e].to(dtype)) for e, part in enumerate(xr.split(counts.tolist()))])
    loop.sum().backward()
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, loop, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(w.grad, wr.grad, **tol)


# Tokens 0..3, k=1: experts 0, 0, 0, 1 with weights .2, .9, .5, .7; expert 0 over a capacity of 2.
CHOSEN, WEIGHTS = torch.tensor([[0], [0], [0], [1]]), torch.tensor([[0.2], [0.9], [0.5], [0.7]])


@pytest.mark.parametrize("by_weight, kept", [(True, [1, 2, 3]), (False, [0, 1, 3])])
def test_capacity_keeps_the_heaviest_or_the_first_pairs(by_weight, kept):
    pairs = Sorted.within_capacity(CHOSEN, WEIGHTS, 2, capacity=2, by_weight=by_weight, pad=False)
    assert sorted(pairs.token.tolist()) == kept and pairs.counts.tolist() == [2, 1]
    assert pairs.token.tolist()[2] == 3  # expert 1's row after expert 0's


def test_padding_to_capacity_gives_every_expert_exactly_its_capacity_in_zero_weight_rows():
    pairs = Sorted.within_capacity(CHOSEN, WEIGHTS, 2, capacity=2, by_weight=True, pad=True)
    assert pairs.counts.tolist() == [2, 2]
    assert pairs.token.tolist() == [1, 2, 3, 0] and pairs.weight.tolist() == pytest.approx([0.9, 0.5, 0.7, 0.0])


def test_capacity_is_the_factor_of_an_even_share():
    assert capacity(moe_config(moe_capacity_factor=1.25), tokens=10) == math.ceil(1.25 * 10 * 2 / 4)


def test_bf16_rows_not_a_multiple_of_16_bytes_fall_back_to_the_loop():
    counts = torch.tensor([2, 3])
    x, w = torch.randn(5, 12).bfloat16(), torch.randn(2, 4, 12)
    assert not grouped_kernel_takes(x, w.bfloat16())
    expected = torch.cat([F.linear(x[:2], w[0].bfloat16()), F.linear(x[2:], w[1].bfloat16())])
    torch.testing.assert_close(grouped_linear(x, w, counts.cumsum(0).to(torch.int32)), expected)


# Each model.activation written out from its formula: what the MLP and the experts must compute.
ACTIVATIONS = {"silu": lambda x: x * torch.sigmoid(x), "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
               "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))}


def _mlp_by_hand(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    h, activation = F.linear(x, fc1), ACTIVATIONS[cfg.features.activation]
    if cfg.features.gated_mlp:
        gate, up = h.chunk(2, dim=-1)
        return F.linear(activation(gate) * up, fc2)
    return F.linear(activation(h), fc2)


def _loop_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer computed token by token, expert by expert: what the sorting and grouping must equal."""
    cfg = layer.router.cfg
    tokens = x.reshape(-1, x.shape[-1])
    routing = route(F.linear(tokens, layer.router.weight), cfg)
    fc1, fc2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e, w in zip(routing.experts[t].tolist(), routing.weights[t]):
            out[t] += w * _mlp_by_hand(tokens[t], fc1[e], fc2[e], cfg)
    shared = _mlp_by_hand(tokens, layer.shared_expert.linear_fc1.weight, layer.shared_expert.linear_fc2.weight, cfg)
    return (out + shared * torch.sigmoid(tokens @ layer.shared_expert_gate.t())).view_as(x)


@pytest.mark.parametrize("gated, activation", [(True, "silu"), (False, "gelu"), (True, "gelu_tanh"),
                                               (False, "silu")])
def test_the_layer_equals_the_loop_over_tokens_and_experts(gated, activation):
    """The experts and the shared expert (a dense MLP) apply model.activation, to the gate when gated."""
    cfg = moe_config(moe_shared_expert_size=24, moe_shared_expert_gate=True, moe_aux_loss_coeff=0.01,
                     gated_mlp=gated, activation=activation)
    model = GPTModel(cfg, torch.device("cpu"), seed=3)
    layer = model.layers["0"].mlp
    x = torch.randn(8, 3, cfg.hidden_size)
    torch.testing.assert_close(layer(x), _loop_moe(layer, x))


def test_balancing_losses_reach_the_router_and_are_counted():
    cfg = moe_config(moe_aux_loss_coeff=0.1, moe_seq_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = GPTModel(cfg, torch.device("cpu"), seed=3)
    layer = model.layers["1"].mlp
    layer.router.aux_losses.start_step(1.0, torch.device("cpu"))
    layer(torch.randn(8, 2, cfg.hidden_size)).sum().backward()
    with_terms = layer.router.weight.grad.clone()
    assert set(layer.router.aux_losses.totals) == {"moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss"}
    layer.router.aux_losses.start_step(0.0, torch.device("cpu"))  # the terms' gradient scaled to nothing
    layer.router.weight.grad = None
    layer(torch.randn(8, 2, cfg.hidden_size)).sum().backward()
    assert not torch.allclose(with_terms, layer.router.weight.grad)



@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_balancing_losses_count_the_plain_top_k_not_the_biased_or_grouped_choice(router):
    """The balancing losses' load f_e is the top-k of the scores alone (DeepSeek-V3's f_i, Megatron-Core's aux-loss
    routing map): an expert bias that pulls every token to expert 3, and a group limit, change where tokens go,
    not what the losses count."""
    cfg = moe_config(moe_router=router, moe_expert_bias=True, moe_router_groups=2, moe_router_group_topk=1,
                     moe_aux_loss_coeff=0.1, moe_seq_aux_loss_coeff=0.1)
    router_ = GPTModel(cfg, torch.device("cpu"), seed=3).layers["1"].mlp.router
    router_.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 50.0]))
    router_.aux_losses.start_step(1.0, torch.device("cpu"))
    x = torch.randn(8, 2, cfg.hidden_size)
    routed = router_(x)
    scores = route(F.linear(x.reshape(16, -1), router_.weight), cfg).scores
    probs = scores / scores.sum(-1, keepdim=True) if router == "sigmoid" else scores
    plain = probs.topk(2, dim=-1).indices
    assert (routed.experts == 3).any(-1).all() and not (plain == 3).any(-1).all()
    counts = expert_counts(plain, 4)
    torch.testing.assert_close(router_.aux_losses.totals["moe_aux_loss"], 0.1 * switch_loss(probs, counts, 16, 2))
    per_sequence = expert_counts(plain.view(8, 2, 2).transpose(0, 1), 4)
    torch.testing.assert_close(router_.aux_losses.totals["moe_seq_aux_loss"],
                               0.1 * sequence_loss(probs.view(8, 2, 4), per_sequence, 8, 2))

def test_selective_recompute_drops_the_experts_activation_and_keeps_the_gradients():
    cfg = moe_config()
    grads, saved = [], []
    rows, counts = torch.randn(10, cfg.hidden_size), torch.tensor([4, 0, 5, 1])
    for mode in ("none", "selective"):
        model = GPTModel(cfg, torch.device("cpu"), seed=3)
        apply_recompute(model, mode)
        experts = model.layers["0"].mlp.experts
        with saved_storages(experts) as seen:
            out = experts(rows, counts)
        out.square().sum().backward()
        saved.append(sum(seen.values()))
        grads.append([p.grad for p in experts.parameters()])
    assert saved[0] - saved[1] == 2 * 10 * cfg.expert_ffn_size * 4  # silu(gate) and the activation, fp32 rows
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed, rtol=0, atol=0)


def test_first_dense_layers_and_the_layer_frequency_pick_the_moe_layers():
    cfg = moe_config(num_layers=6, moe_first_dense_layers=1, moe_layer_freq=2)
    model = GPTModel(cfg, torch.device("meta"), seed=0)
    assert [i for i, layer in model.layers.items() if isinstance(layer.mlp, MoELayer)] == ["1", "3", "5"]


def test_expert_weights_are_slices_of_the_one_device_experts():
    """Rank 1 of ep 2 holds experts 2 and 3 of the one-device model, drawn at full shape."""
    cfg = moe_config()
    whole = GPTModel(cfg, torch.device("cpu"), seed=5)
    part = GPTModel(cfg, torch.device("cpu"), ParallelContext(ep=AxisView(None, 1, 2)), seed=5)
    name = "layers.0.mlp.experts.linear_fc2.weight"
    torch.testing.assert_close(dict(part.named_parameters())[name], dict(whole.named_parameters())[name][2:])
    assert part.placements_by_name()[name].grid == "expert"


@pytest.mark.parametrize("fields, world, message", [
    (dict(model={"num_experts": 6}, parallel={"ep": 4}), 4, "not divisible by parallel.ep=4"),
    (dict(model={"num_experts": 4, "moe_topk": 5}), 1, "moe_topk=5"),
    (dict(model={"num_experts": 4}, parallel={"tp": 2}), 2, "need parallel.sequence_parallel=true"),
    (dict(parallel={"ep": 2}), 2, "parallel.ep=2 need experts"),
    (dict(model={"num_experts": 4, "moe_router_groups": 3}), 1, "moe_router_groups=3"),
    (dict(model={"num_experts": 4, "moe_first_dense_layers": 2}), 1, "no layer is a mixture of experts"),
    (dict(model={"num_experts": 4}, parallel={"ep": 4, "pp": 2}), 4, "parallel.etp*parallel.ep*parallel.pp=8"),
    (dict(model={"num_experts": 4, "moe_ffn_hidden_size": 6}, parallel={"etp": 4}), 4,
     "not divisible by parallel.etp=4"),
    (dict(parallel={"etp": 2}), 2, "parallel.etp=2 need experts"),
    (dict(model={"num_experts": 4, "moe_pad_to_capacity": True}), 1, "needs a model.moe_capacity_factor"),
    (dict(model={"num_experts": 4, "moe_capacity_factor": 1.0}, parallel={"moe_dispatcher": "allgather"}), 1,
     "needs parallel.moe_dispatcher=alltoall"),
])
def test_moe_settings_are_checked(fields, world, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace(".", r"\.")):
        validate(tiny_config(**fields), world)

