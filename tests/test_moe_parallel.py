"""Expert parallelism equals one device holding every expert: the same losses, gradient norms and logged routing
figures (balancing terms, load imbalance per layer) (fp32, dropless, clipping active, every balancing loss and
the auxiliary-loss-free expert bias on, with a rate that changes choices within the run) at
every layout of four ranks, the expert grid folded over the dense one (ep up to tp x cp x dp). All layouts run
one after another on one group of four spawned ranks."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import metrics, run_ranks
from parity import LLAMA, TINY

from megalite.config_cli import parse_config
from megalite.training.pretrain import pretrain

MOE = [*LLAMA, "--model.num_experts=4", "--model.moe_topk=2", "--model.moe_ffn_hidden_size=32",
       "--model.moe_aux_loss_coeff=0.01", "--model.moe_seq_aux_loss_coeff=0.01", "--model.moe_z_loss_coeff=0.001",
       "--model.moe_shared_expert_size=32", "--model.moe_shared_expert_gate=true", "--model.moe_first_dense_layers=1",
       "--model.moe_expert_bias=true", "--model.moe_bias_update_rate=0.05"]

LAYOUTS = {
    "ep4": ["--parallel.ep=4"],
    "ep2 x edp2, distributed optimizer": ["--parallel.ep=2", "--parallel.distributed_optimizer=true"],
    "tp2 SP x ep2": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2"],
    "tp2 SP x ep4 (ep over tp x dp)": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=4"],
    "tp2 SP x ep2 x etp2 (experts split like the dense MLP)": [
        "--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2", "--parallel.etp=2"],
    "etp4 (no ep)": ["--parallel.etp=4"],
    "ep2 x etp2, all-gather dispatcher": ["--parallel.ep=2", "--parallel.etp=2", "--parallel.moe_dispatcher=allgather"],
    "pp2 (vp2) x ep2": ["--parallel.pp=2", "--parallel.vp=2", "--parallel.ep=2"],
    "cp2 x ep2": ["--parallel.cp=2", "--parallel.ep=2"],
    "ep2, ZeRO-3": ["--parallel.ep=2", "--parallel.zero_stage=3"],
    "ep4, ZeRO-3 (experts whole: edp 1)": ["--parallel.ep=4", "--parallel.zero_stage=3"],
    "tp4 SP, ZeRO-3 (only the experts sharded: dp 1, edp 4)": ["--parallel.tp=4", "--parallel.sequence_parallel=true",
                                                                "--parallel.zero_stage=3"],
    "pp2 (vp2) x edp2 (an expert and a dense buffer per chunk)": ["--parallel.pp=2", "--parallel.vp=2"],
    "ep4, all-gather dispatcher": ["--parallel.ep=4", "--parallel.moe_dispatcher=allgather"],
    "ep2, full recompute": ["--parallel.ep=2", "--train.recompute=full"],
}
# With an expert capacity each rank drops from its own tokens: at layouts that do not split a micro batch's
# tokens (ep, etp, dp, pp) the drops are one device's.
CAPACITY = ["--model.moe_capacity_factor=0.75"]
CAPACITY_LAYOUTS = {
    "ep4, capacity 0.75, dropping the lowest weights": ["--parallel.ep=4"],
    "ep2 x etp2, capacity 0.75 padded (no host read)": ["--parallel.ep=2", "--parallel.etp=2",
                                                         "--model.moe_pad_to_capacity=true"],
}
# A run saved at ep 4 (step 3 of 5) resumed at other expert layouts: steps 4 and 5 as if never stopped.
SAVED = ["--parallel.ep=4", "--parallel.distributed_optimizer=true", "--checkpoint.save={root}/ep4",
         "--train.exit_interval=3"]
RESUMED = {
    "ep2 x edp2, distributed optimizer": ["--parallel.ep=2", "--parallel.distributed_optimizer=true"],
    "ep1 (every rank holds every expert)": [],
    "ep2 x etp2": ["--parallel.ep=2", "--parallel.etp=2"],
    "tp2 SP x ep2, ZeRO-2": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2",
                              "--parallel.zero_stage=2"],
}
ROUTING_FIGURES = ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss", "moe_load_imbalance/layer_1",
                   "moe_load_imbalance/layer_3")


def _runs(rank: int, world_size: int, root: str, layouts: dict[str, list[str]]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    for index, extra in enumerate(layouts.values()):
        args = [arg.format(root=root) for arg in extra]
        pretrain(parse_config([*TINY, *MOE, *args, f"--logging.metrics_file={root}/run{world_size}-{index}.jsonl"]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    layouts = LAYOUTS | {name: [*CAPACITY, *extra] for name, extra in CAPACITY_LAYOUTS.items()} | {
        "saved": SAVED} | {f"resumed at {name}": [*extra, "--checkpoint.load={root}/ep4"]
                           for name, extra in RESUMED.items()}
    references = {"one device": [], "one device, capacity 0.75": CAPACITY,
                  "one device, no expert bias": ["--model.moe_expert_bias=false"]}
    run_ranks(1, _runs, str(root), references)
    run_ranks(4, _runs, str(root), layouts)
    return {name: metrics(root / f"run4-{i}.jsonl") for i, name in enumerate(layouts)} | {
        name: metrics(root / f"run1-{i}.jsonl") for i, name in enumerate(references)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS) + sorted(CAPACITY_LAYOUTS))
def test_expert_parallel_layout_equals_one_device(runs, layout):
    reference, records = runs["one device, capacity 0.75" if layout in CAPACITY_LAYOUTS else "one device"], runs[layout]
    assert len(records) == len(reference) == 5
    assert all(r["grad_norm"] > 0.5 for r in reference), "clipping must be active"
    for mine, one in zip(records, reference):
        assert mine["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        figures = [*ROUTING_FIGURES, *(["moe_dropped_fraction"] if layout in CAPACITY_LAYOUTS else [])]
        assert {k: mine[k] for k in figures} == pytest.approx({k: one[k] for k in figures}, rel=1e-5)


@pytest.mark.parametrize("layout", sorted(RESUMED))
def test_a_run_saved_at_ep4_resumes_at_another_expert_layout(runs, layout):
    """Experts are stored by their global index, with their optimizer state, the routers' expert biases and the
    data position."""
    assert [r["step"] for r in runs["saved"]] == [1, 2, 3]
    records, reference = runs[f"resumed at {layout}"], runs["one device"][3:]
    assert [r["step"] for r in records] == [4, 5]
    for mine, one in zip(records, reference):
        assert mine["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


def test_a_capacity_drops_pairs_and_says_how_many(runs):
    dropped = [r["moe_dropped_fraction"] for r in runs["one device, capacity 0.75"]]
    assert max(dropped) > 0.0 and all(0.0 <= d < 1.0 for d in dropped)
    assert "moe_dropped_fraction" not in runs["one device"][0]


def test_the_expert_bias_changes_the_routing_after_the_first_step(runs):
    with_bias, without = ([r["loss"] for r in runs[name]] for name in ("one device", "one device, no expert bias"))
    assert with_bias[0] == without[0] and with_bias[1:] != pytest.approx(without[1:], rel=1e-6)


def _without_expert_grid(rank: int, world_size: int) -> str:
    from conftest import tiny_config

    from megalite.parallel.topology import Topology
    from megalite.training.build import build_trainer

    cfg = tiny_config(model={"num_experts": 4})
    try:
        build_trainer(cfg, Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel))
    except ValueError as error:
        return str(error)
    return "built"


def test_a_topology_without_the_expert_grid_is_refused_with_the_fix():
    assert "build it with experts=True" in run_ranks(1, _without_expert_grid)[0]
