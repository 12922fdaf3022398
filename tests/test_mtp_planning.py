"""Multi-token prediction in what megalite counts from the model: its FLOPs in MFU, its parameters (and the head
stage's copy of the word embeddings) and activations in the planner, and the dry run of a pipeline holding it."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import tiny_config

from megalite.config import Config
from megalite.config_cli import apply_mapping
from megalite.dryrun.report import TOLERANCE, difference, format_dry_run
from megalite.dryrun.run import dry_run
from megalite.model import costs
from megalite.planning.activations import chunk_costs
from megalite.planning.built import micro_batch, one_device_model
from megalite.planning.measure import MEASUREMENT, measurement_config
from megalite.planning.parameters import rank_parameters
from megalite.training.flops import hardware_flops_per_token, recomputed_flops_per_token, training_flops_per_token


def _with_mtp(cfg: Config, depths: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_num_layers=depths))


def test_mtp_flops_count_each_depth_as_a_layer_a_projection_and_a_head():
    """Per token and depth: the layer's matmuls and attention (a layer of the main model's kind), eh_proj's 2h x h
    weights and the head's h x vocabulary, forward and backward."""
    cfg = tiny_config("llama")
    m, layer = cfg.model, one_device_model(cfg.model).layers["1"]
    per_depth = 6 * (costs.matmul_parameters(layer) + 2 * m.hidden_size**2 + m.hidden_size * m.vocab) \
        + 3 * costs.attention_flops(layer, m.seq_length)
    assert training_flops_per_token(_with_mtp(cfg, 2).model) == training_flops_per_token(m) + 2 * per_depth


def test_recompute_reruns_each_depths_layer_in_the_hardware_flops():
    """Hardware FLOPs (HFU) count the forward that recompute reruns in each depth's transformer layer as in a main
    layer of its kind: the whole layer under full recompute, the core attention under selective."""
    cfg = tiny_config("llama")
    m, depths = cfg.model, _with_mtp(cfg, 2).model
    for mode in ("full", "selective"):
        per_layer = recomputed_flops_per_token(m, mode) / m.num_layers
        assert per_layer > 0
        assert recomputed_flops_per_token(depths, mode) == pytest.approx(per_layer * (m.num_layers + 2))
        assert hardware_flops_per_token(depths, mode) == pytest.approx(
            training_flops_per_token(depths) + per_layer * (m.num_layers + 2))


def test_the_planner_counts_mtp_on_the_head_stage_with_its_copy_of_the_embeddings():
    cfg = tiny_config("llama", parallel={"pp": 2})
    m, h = cfg.model, cfg.model.hidden_size
    layer = one_device_model(m).layers["1"]
    depth_parameters = sum(p.numel() for p in layer.parameters()) + 3 * h + 2 * h * h  # + norms and eh_proj
    with_mtp = _with_mtp(cfg, 1)
    assert rank_parameters(with_mtp, 0) == rank_parameters(cfg, 0)
    before, after = rank_parameters(cfg, 1), rank_parameters(with_mtp, 1)
    assert after.total - before.total == depth_parameters + m.padded_vocab_size * h
    assert len(after.units) == len(before.units) + 1  # MTP is one ZeRO-3 gather unit
    one_stage = tiny_config("llama")  # untied: MTP reads the embedding unit's table, which stays gathered
    assert rank_parameters(_with_mtp(one_stage, 1), 0).tied_head and not rank_parameters(one_stage, 0).tied_head
    saved = [chunk_costs(c, 1, "cpu", costs.saved_bytes)[0] for c in (cfg, with_mtp)]
    batch, head = micro_batch(cfg, "cpu"), one_device_model(m).lm_head
    assert saved[1] - saved[0] > costs.saved_bytes(layer, batch) + costs.saved_bytes(head, batch)


def test_a_pipeline_with_mtp_dry_runs_within_the_planner():
    tiny = {"model": {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                      "num_query_groups": 2, "seq_length": 32, "vocab_size": 256, "mtp_num_layers": 1},
            "parallel": {"tp": 2, "pp": 2, "sequence_parallel": True, "distributed_optimizer": True},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "precision": "bf16", "param_dtype": "bf16"}}
    cfg = measurement_config(8, **tiny)
    apply_mapping(cfg, MEASUREMENT, "dry run")
    report = dry_run(cfg, 8, 3)
    text = format_dry_run(report, "h100")
    assert report.ok, text
    head = next(run for run in report.ranks if run.role.pp_rank == 1)  # this tiny model's first stage is off by 7%
    plan = report.plan(head)  # without MTP too: its transients are the CPU's, not what MTP adds
    assert abs(head.memory["activations"] - plan.activations) / plan.activations <= TOLERANCE, text
    assert abs(difference(head, plan)) <= TOLERANCE, text


def test_the_heads_gradient_waiting_for_the_mtp_depths_read_is_planned():
    """The head's weight is read by the main head and again by the MTP depth: in backward its first read's
    gradient waits in a tensor of its size (parallel/grad_buffer.py deposit) while the depth's is made, two
    head-sized gradients at once, which with a large vocabulary is the head stage's transient peak."""
    tiny = {"model": {"family": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                      "num_query_groups": 2, "seq_length": 32, "vocab_size": 16384, "mtp_num_layers": 1},
            "parallel": {"pp": 2, "distributed_optimizer": True},
            "train": {"micro_batch_size": 1, "global_batch_size": 2, "precision": "bf16", "param_dtype": "bf16"}}
    cfg = measurement_config(2, **tiny)
    apply_mapping(cfg, MEASUREMENT, "dry run")
    report = dry_run(cfg, 2, 1)
    head = next(run for run in report.ranks if run.role.pp_rank == 1)
    plan = report.plan(head)
    assert head.memory["transient"] >= 2 * 16384 * 128 * 2  # two bf16 head-sized gradients
    assert head.memory["transient"] == pytest.approx(plan.transient, rel=0.01)
    assert abs(difference(head, plan)) <= TOLERANCE
