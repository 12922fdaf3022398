"""DeepSeek-V3-class Megatron-LM checkpoints (multi-latent attention, DeepSeek routing, multi-token prediction)
converted by tools/convert_checkpoint.py --from-megatron (megalite/checkpoint/megatron/mla.py).

The fixtures are Megatron-LM's own (tests/fixtures/megatron/make_fixtures.py, megatron-core 0.19.2, the local
spec): mla_torch, dense MLA with query compression and YaRN at tp 2 x pp 2 (legacy format, distributed
optimizer); mla_pp2_torch, the same at pp 2 x dp 2, whose next step test_megatron_convert.py takes (Megatron's own
steps at tp > 1 miss part of the rotary key's gradient, see make_fixtures.py); and mla_moe_torch_dist, MLA with a
first dense layer, then experts with a shared expert, sigmoid scores with an expert bias and group-limited routing
over ep 2, and one multi-token-prediction depth (torch_dist, flat-bucket optimizer state). test_megatron_convert.py
checks their logits against Megatron's forward and their flat optimizer state (mla_moe_torch_dist's next step is
not Megatron's: megalite's multi-token-prediction loss divides by the main loss's token count, Megatron's by the
depth's own predictions); this file their config, Megatron's logged multi-token-prediction loss, that the rotary
reordering and YaRN are what make the logits equal, and what is refused.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from test_megatron_convert import convert_each, expected, unpack

from megalite.checkpoint.megatron.args import model_config
from megalite.checkpoint.megatron.mla import to_megalite_layout
from megalite.checkpoint.megatron.names import Sharding, megalite_name, merge_tensor_parallel, split_tensor_parallel
from megalite.checkpoint.megatron.param_order import chunk_parameters
from megalite.checkpoint.megatron.safe_pickle import load_megatron_pickle
from megalite.data.batches import BatchMaker
from megalite.data.mtp_targets import mtp_targets
from megalite.inference.generate import load_model
from megalite.model.gpt import GPTModel

NAMES = ["mla_torch", "mla_moe_torch_dist"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    return unpack(NAMES, tmp_path_factory)


@pytest.fixture(scope="module")
def converted(megatron, tmp_path_factory):
    return convert_each(megatron, tmp_path_factory)


def test_mla_mtp_and_routing_config_come_from_megatrons_args(converted):
    m = load_model(converted["mla_torch"], torch.device("meta"))[1].model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.head_dim, m.features.qk_norm) == (True, 10, 8, 4, 4, 6, None, False)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_positions, m.rope_beta_fast, m.rope_beta_slow,
            m.rope_mscale, m.rope_mscale_all_dim, m.rope_truncate) == ("yarn", 4.0, 4096, 32.0, 1.0, 1.0, 0.8, True)
    m = load_model(converted["mla_moe_torch_dist"], torch.device("meta"))[1].model
    assert (m.q_lora_rank, m.rope_scaling, m.mtp_num_layers, m.mtp_loss_scaling_factor) == (12, "none", 1, 0.3)
    assert (m.num_experts, m.moe_topk, m.moe_router, m.moe_expert_bias, m.moe_router_groups, m.moe_router_group_topk,
            m.moe_scaling_factor, m.moe_first_dense_layers, m.moe_shared_expert_size) == (
        4, 2, "sigmoid", True, 2, 1, 2.0, 1, 16)


def test_megatrons_mtp_loss_is_megalites(megatron, converted):
    """The prediction depth's mean loss over its predictions, as Megatron logged it for the probe batch, from
    megalite's converted model (its summed depth loss over the same predictions)."""
    want = expected(megatron, "mla_moe_torch_dist")
    model, cfg, _ = load_model(converted["mla_moe_torch_dist"], torch.device("cpu"))
    samples = torch.cat([want["tokens"], want["mtp_labels"][:, -1:]], dim=1)
    batch = BatchMaker()(list(samples.numpy()))
    targets = mtp_targets(batch.labels, batch.loss_mask, None, cfg.model.mtp_num_layers)
    model.aux_losses.start_step(1.0, torch.device("cpu"))
    with torch.no_grad():
        model(batch.tokens, batch.labels, mtp=targets)
    means = [float(model.aux_losses.totals[f"mtp_{k + 1}"] / targets.loss_mask[k].sum()) for k in range(1)]
    assert means == pytest.approx(want["mtp_losses"].tolist(), abs=2e-6)


def test_interleaved_rotary_rows_and_yarn_are_what_makes_the_logits_megatrons(megatron, converted):
    """Megatron's MLA rotates the interleaved rotary channels (module docstring of mla.py): left in Megatron's
    order, or without YaRN, the converted model's logits are more than 10 times the tolerance from Megatron's."""
    want = expected(megatron, "mla_torch")
    model, cfg, _ = load_model(converted["mla_torch"], torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model(want["tokens"])[..., :64], want["logits"], atol=2e-6, rtol=0)
    back = {}
    for name, tensor in model.state_dict().items():
        rows = torch.arange(tensor.shape[0]).float()[:, None]
        back[name] = tensor[torch.argsort(to_megalite_layout(name, rows, cfg.model)[:, 0].long())]
    variants = [(cfg.model, back), (dataclasses.replace(cfg.model, rope_scaling="none"), model.state_dict())]
    for variant, tensors in variants:
        other = GPTModel(variant, torch.device("cpu"), seed=0)
        other.load_state_dict(tensors)
        with torch.no_grad():
            assert (other.eval()(want["tokens"])[..., :64] - want["logits"]).abs().max() > 10 * 2e-6


def _args(megatron) -> argparse.Namespace:
    rank_file = megatron["mla_torch"] / "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
    return load_megatron_pickle(rank_file, str(rank_file))["args"]


@pytest.mark.parametrize(("change", "message"), [
    ({"qk_layernorm": False}, "args.multi_latent_attention=True without args.qk_layernorm (Megatron's latents are "
                              "then not normalised"),
    ({"mla_down_proj_fusion": True}, "args.mla_down_proj_fusion=True (the fused linear_qkv_down_proj is not read"),
    ({"mscale": 0.5, "mscale_all_dim": 0.0}, "args.mscale=0.5 with args.mscale_all_dim=0.0"),
    ({"mtp_num_layers": 2, "mtp_use_repeated_layer": True}, "args.mtp_use_repeated_layer=True"),
    ({"mtp_num_layers": 1, "num_experts": 4, "moe_router_topk": 2, "add_bias_linear": False, "moe_layer_freq": 2},
     "args.mtp_num_layers=1 with args.moe_layer_freq=2 (Megatron's prediction layers are of the last decoder "
     "layer's kind"),
])
def test_what_megalite_does_not_compute_is_named(megatron, change, message):
    args = argparse.Namespace(**vars(_args(megatron)) | change)
    with pytest.raises(ValueError, match="Megatron-LM model options megalite does not compute: .*" + message.replace(
            "(", r"\(").replace(")", r"\)")):
        model_config(args, "ckpt")


def test_down_projections_are_split_by_the_local_spec_and_whole_in_transformer_engines():
    """The local spec's down-projections are column-parallel (rows split over tp), Transformer Engine's duplicated
    (every rank's copy whole); the up-projections and eh_proj are column-parallel under both."""
    whole = torch.arange(24.0).view(6, 4)
    down = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    for name in (down, "decoder.layers.0.self_attention.linear_kv_up_proj.weight", "mtp.layers.0.eh_proj.weight",
                 "mtp.layers.0.mtp_model_layer.self_attention.linear_q_up_proj.weight"):
        shards = split_tensor_parallel(name, whole, 2, Sharding(True, True))
        assert [s.shape[0] for s in shards] == [3, 3]
        assert torch.equal(merge_tensor_parallel(name, shards, Sharding(True, True), "ckpt"), whole)
    copies = split_tensor_parallel(down, whole, 2, Sharding(True, False))
    assert all(torch.equal(c, whole) for c in copies)
    assert torch.equal(merge_tensor_parallel(down, copies, Sharding(True, False), "ckpt"), whole)


def test_transformer_engines_names_and_order_under_mla():
    """Transformer Engine's spec fuses the latent norms into the up-projections (`layer_norm_weight`, registered
    before the weight) and keeps MLA's input norm a module of its own, first in the layer; a prediction depth's
    layer is `transformer_layer` or `mtp_model_layer`, between eh_proj and its final norm."""
    inner = ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_q_down_proj.weight",
             "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
             "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
             "self_attention.linear_kv_up_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
             "mlp.linear_fc2.weight"]
    mtp = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
           *(f"mtp.layers.0.mtp_model_layer.{n}" for n in inner), "mtp.layers.0.final_layernorm.weight"]
    names = ["embedding.word_embeddings.weight", *(f"decoder.layers.0.{n}" for n in inner),
             "decoder.final_layernorm.weight", *mtp, "output_layer.weight"]
    args = argparse.Namespace(num_layers=1, pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=True,
                              transformer_impl="transformer_engine", multi_latent_attention=True)
    assert [p.name for p in chunk_parameters(sorted(names), args, 0, 0, 0, None)] == names
    assert megalite_name(names[4], False, "ckpt", mla=True) == "layers.0.attention.q_layernorm.weight"
    kv_norm = "mtp.layers.0.transformer_layer.attention.kv_layernorm.weight"
    assert megalite_name(mtp[3 + 6], False, "ckpt", mla=True) == kv_norm
    with pytest.raises(ValueError, match="multi-token-prediction run at pipeline parallel 2 is not read"):
        chunk_parameters(names, argparse.Namespace(**vars(args) | {"pipeline_model_parallel_size": 2,
                                                                   "num_layers": 2}), 1, 0, 0, None)
