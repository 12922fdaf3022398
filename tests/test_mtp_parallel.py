"""Multi-token prediction at every layout equals one device (fp32): the losses, each depth's loss and every
gradient, for a DeepSeek-V3-shaped tiny model (latent attention with query compression, experts routed as
released with a shared expert and a dense first layer, two MTP depths whose layers have latent attention and
experts), on documents (end-of-document tokens masked, positions restarting) so that
each depth's document masks are tested too. The pipeline's head stage holds MTP and its copy of the word
embeddings (on the first rank under ZB-V); context parallelism cuts the targets from whole sequences. All layouts
run one after another on one group of four spawned ranks."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks
from parity import assert_equals_one_device, on_one_device, train_and_gather

from megalite.config import Config
from megalite.config_validation import validate
from megalite.data.batches import BatchMaker
from megalite.data.mock import MockDataset
from megalite.parallel.topology import Topology
from megalite.training.build import is_logging_rank
from megalite.training.mtp_metrics import MTPMetrics

EOD = 3
VOCAB = 250


class _Documents(MockDataset):
    """Mock samples over 16 token ids, of which EOD ends a document: about two per sample."""

    def __getitem__(self, index: int):
        return super().__getitem__(index) % 16


def _config(train: dict | None = None, tied: bool = False, **parallel) -> Config:
    model = {"tie_embeddings": tied, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": None,
             "multi_latent_attention": True, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_head_dim": 8,
             "qk_pos_emb_head_dim": 4, "v_head_dim": 6, "vocab_size": VOCAB, "num_experts": 4, "moe_topk": 2,
             "moe_ffn_hidden_size": 32, "moe_shared_expert_size": 32, "moe_router": "sigmoid", "moe_router_groups": 2,
             "moe_router_group_topk": 1, "moe_router_group_experts": 2, "moe_scaling_factor": 2.5,
             "moe_norm_topk_prob": True, "moe_expert_bias": True, "moe_first_dense_layers": 1,
             "moe_aux_loss_coeff": 0.01, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}
    cfg = tiny_config("llama", model=model, parallel=parallel, train={"micro_batch_size": 1, "global_batch_size": 8,
                                                                      **(train or {})})
    cfg.data.reset_position_ids = cfg.data.eod_mask_loss = True
    return cfg


LAYOUTS = [  # (name, parallel fields, train fields, tied embeddings)
    ("tp 2 SP x dp 2", {"tp": 2, "sequence_parallel": True}, {}, False),
    ("pp 2 x cp 2 (MTP's copy of the embeddings; targets from the neighbouring chunk)", {"pp": 2, "cp": 2}, {}, False),
    ("ZB-V pp 2 x dp 2 (MTP on the first rank)", {"pp": 2, "vp": 2, "pipeline_schedule": "zb-v"}, {}, False),
    ("DualPipeV pp 2 x ep 2 (MTP's experts in paired forward and backward)",
     {"pp": 2, "vp": 2, "pipeline_schedule": "dualpipev", "ep": 2}, {}, False),
    ("ep 2 x dp 2, ZeRO-3, full recompute", {"ep": 2, "zero_stage": 3}, {"recompute": "full"}, False),
    ("tp 2 SP x dp 2 x ep 2, distributed optimizer, overlapped gathers", {
        "tp": 2, "sequence_parallel": True, "ep": 2, "distributed_optimizer": True, "overlap_param_gather": True},
     {}, False),
    ("pp 2 x dp 2, tied embeddings (MTP reads the head's copy), distributed optimizer, overlapped gathers", {
        "pp": 2, "distributed_optimizer": True, "overlap_param_gather": True}, {}, True),
    ("ZB-V pp 2 x cp 2 x ep 2 (pipeline, context and expert parallel together: MTP on the first rank, targets from "
     "the neighbouring chunk, experts over the cp ranks)", {"pp": 2, "vp": 2, "pipeline_schedule": "zb-v", "cp": 2,
                                                            "ep": 2}, {}, False),
]


def _train(cfg: Config, topology: Topology) -> tuple[list, dict[str, torch.Tensor]]:
    """Each step's loss and depth losses (as logged), and the last step's whole gradients."""
    metrics = MTPMetrics(cfg.model.mtp_num_layers, topology)

    def record(trainer, result) -> dict:
        metrics.add_step(trainer.model.aux_losses, result.tokens_on_device)
        return {"loss": result.loss, **metrics.read()}

    data = _Documents(VOCAB, cfg.model.seq_length, cfg.train.seed)
    return train_and_gather(cfg, topology, data=data, maker=BatchMaker(EOD, True, True), record=record)


def _four_ranks(rank: int, world_size: int, layouts: list) -> list:
    results = []
    for _, parallel, train, tied in layouts:
        cfg = _config(train, tied, **parallel)
        validate(cfg, world_size)
        records, gradients = _train(cfg, cpu_topology(rank, world_size, cfg))
        logging = is_logging_rank(cfg, Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel, True))
        results.append((records if logging else None, gradients))
    return results


@pytest.fixture(scope="module")
def four_ranks() -> list:
    return run_ranks(4, _four_ranks, LAYOUTS)


@pytest.fixture(scope="module")
def one_device() -> dict[bool, tuple[list, dict[str, torch.Tensor]]]:
    """The one-device runs, untied and tied."""
    return {tied: on_one_device(_config(tied=tied), _train) for tied in (False, True)}


def test_mtp_losses_are_logged_per_depth_and_train(one_device):
    records, gradients = one_device[False]
    assert all(set(r) == {"loss", "mtp_1_loss", "mtp_2_loss"} for r in records)
    assert all(0 < r["mtp_2_loss"] < r["mtp_1_loss"] * 1.5 for r in records)
    assert gradients["mtp.layers.1.eh_proj.weight"].abs().sum() > 0
    assert gradients["mtp.layers.1.transformer_layer.mlp.experts.linear_fc1.weight"].abs().sum() > 0


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_mtp_layout_equals_one_device(four_ranks, one_device, index):
    records = next(r[index][0] for r in four_ranks if r[index][0] is not None)
    reference, gradients = one_device[LAYOUTS[index][3]]
    for mine, one in zip(records, reference, strict=True):
        assert mine == pytest.approx(one, rel=1e-5), LAYOUTS[index][0]
    assert_equals_one_device(LAYOUTS[index][0], [r["loss"] for r in records], four_ranks, index,
                             ([r["loss"] for r in reference], gradients))
