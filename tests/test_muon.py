"""Muon (optim.optimizer=muon): one device's update is torch.optim.Muon's on transformers' separate matrices
(bf16) or the same iteration in fp32, and every layout's losses and updated weights equal one device's (fp32):
tensor + sequence, pipeline, context, data parallelism with the distributed optimizer, ZeRO-3, experts over ep and
etp. The layouts share one spawned group of four ranks; one device runs in a group of one."""

from __future__ import annotations

import math
import os

import pytest
import torch
from distributed import cpu_topology, metrics, run_ranks
from parity import LLAMA, TINY, whole_shards

from megalite.checkpoint.hf_mapping import to_hf
from megalite.config import ConfigError
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.data.batches import BatchMaker
from megalite.data.loader import micro_batches
from megalite.data.mock import MockDataset
from megalite.dryrun.run import dry_run
from megalite.model.gpt import GPTModel
from megalite.parallel.muon import newton_schulz, update_scale
from megalite.parallel.muon_plan import MuonPlan
from megalite.parallel.placement import DATA_AXES, Fused, Placement, ShardSpec
from megalite.parallel.topology import RankGrid
from megalite.planning.measure import measurement_config
from megalite.training.build import build_trainer
from megalite.training.pretrain import pretrain
from megalite.training.step import train_step

MUON = [*TINY, *LLAMA, "--optim.optimizer=muon", "--optim.lr=0.01", "--optim.min_lr=0.01",
        "--train.global_batch_size=4"]
MOE = ["--model.num_experts=4", "--model.moe_topk=2", "--model.moe_ffn_hidden_size=32",
       "--model.moe_first_dense_layers=1"]
# DeepSeek-V3's shape in miniature: latent attention (its down-projections whole on every tensor-parallel rank)
# and multi-token prediction (its layer and projection are matrices too), over experts.
LATENT = ["--model.multi_latent_attention=true", "--model.num_query_groups=null", "--model.kv_lora_rank=16",
          "--model.q_lora_rank=12", "--model.qk_head_dim=8", "--model.qk_pos_emb_head_dim=4", "--model.v_head_dim=6",
          "--model.mtp_num_layers=1"]
DEEPSEEK = [*MOE, *LATENT]
CLIP = ["--optim.qk_clip_threshold=0.09"]  # the tiny model's heads reach about 0.1: many are clipped
LATENT_CLIP = ["--optim.qk_clip_threshold=0.028"]  # latent attention's heads reach about 0.03 in the tiny model
REFERENCES = {"dense": [], "moe": MOE, "dense, QK-clip": CLIP, "deepseek": DEEPSEEK, "latent": LATENT,
              "latent, QK-clip": [*LATENT, *LATENT_CLIP]}
LAYOUTS = {  # (arguments, the one-device reference)
    "tp2 SP x dp2, distributed optimizer": (["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                             "--parallel.distributed_optimizer=true"], "dense"),
    "pp2 x cp2": (["--parallel.pp=2", "--parallel.cp=2"], "dense"),
    "tp2 x ZeRO-3 over dp2": (["--parallel.tp=2", "--parallel.zero_stage=3"], "dense"),
    "ZeRO-2 over dp4, CPU offload": (["--parallel.zero_stage=2", "--optim.offload=cpu"], "dense"),
    "ep2 x etp2": ([*MOE, "--parallel.ep=2", "--parallel.etp=2"], "moe"),
    "ep2 x edp2, distributed optimizer": ([*MOE, "--parallel.ep=2", "--parallel.distributed_optimizer=true"], "moe"),
    "tp2 SP x dp2, distributed optimizer, QK-clip": ([*CLIP, "--parallel.tp=2", "--parallel.sequence_parallel=true",
                                                      "--parallel.distributed_optimizer=true"], "dense, QK-clip"),
    "cp2 (ring) x dp2, QK-clip": ([*CLIP, "--parallel.cp=2"], "dense, QK-clip"),
    "cp2 (all-gather) x tp2 SP, QK-clip": ([*CLIP, "--parallel.cp=2", "--parallel.cp_comm=allgather",
                                           "--parallel.tp=2", "--parallel.sequence_parallel=true"], "dense, QK-clip"),
    "latent attention + MTP, tp2 SP x ep2, distributed optimizer": ([*DEEPSEEK, "--parallel.tp=2",
                                                                      "--parallel.sequence_parallel=true",
                                                                      "--parallel.ep=2",
                                                                      "--parallel.distributed_optimizer=true"],
                                                                     "deepseek"),
    "latent attention + MTP, tp2 x dp2, QK-clip": ([*LATENT, *LATENT_CLIP, "--parallel.tp=2"], "latent, QK-clip"),
}
# QK-clip's caps on one device and at tp2 x dp2, for standard and latent attention
CAPS = {"dense": ["--parallel.tp=2", "--parallel.distributed_optimizer=true"], "latent": [*LATENT, "--parallel.tp=2"]}
STEPS = 2
# pretrain_gpt.py's runs: a Muon run saved at tp2 SP x dp2 (step 3 of 5) resumed at pp2 x tp2 as if never stopped,
# and refused by an AdamW run unless its optimizer state is left behind.
SAVED = ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.distributed_optimizer=true",
         "--checkpoint.save={root}/muon", "--train.exit_interval=3"]
RUNS = {"saved": SAVED, "resumed at pp2 x tp2": ["--parallel.pp=2", "--parallel.tp=2", "--checkpoint.load={root}/muon"],
        "resumed at ZeRO-3 over dp4": ["--parallel.zero_stage=3", "--checkpoint.load={root}/muon"],
        "adamw refused": ["--optim.optimizer=adamw", "--checkpoint.load={root}/muon"],
        "adamw, fresh optimizer state": ["--optim.optimizer=adamw", "--checkpoint.load={root}/muon",
                                         "--checkpoint.load_optimizer=false", "--train.train_iters=4"],
        "QK-clip at pp2 x tp2": ["--optim.qk_clip_threshold=0.09", "--parallel.pp=2", "--parallel.tp=2",
                                 "--train.train_iters=1"]}


def _pretrain(rank: int, world_size: int, root: str, runs: dict[str, list[str]]) -> dict[str, str]:
    """pretrain_gpt.py's run of each entry in this group; the error each run stopped with, by name."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    errors = {}
    for name, extra in runs.items():
        args = [*MUON, *(arg.format(root=root) for arg in extra), f"--logging.metrics_file={root}/{name}.jsonl"]
        try:
            pretrain(parse_config(args))
        except ValueError as error:
            errors[name] = str(error)
    return errors


def _batches(cfg, topology, step: int) -> list:
    data, gbs = MockDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed), cfg.batch_size(
        topology.world_size)
    return list(micro_batches(data, BatchMaker(), step * gbs, (step + 1) * gbs, 1, topology.dp, topology.dp_rank, 0,
                              topology.device))


def _capped(rank: int, world_size: int, extra: list[str]) -> tuple[list[float], float, list[float]]:
    """QK-clip on a batch whose heads' largest logits are known: a step (learning rate ~0) measures them with the
    threshold out of reach, one with the threshold between their extremes clips, and a third measures them again.
    Returns this rank's heads' maxima before, the threshold, and after."""
    cfg = parse_config([*MUON, *extra, "--optim.lr=1e-12", "--optim.min_lr=1e-12", "--optim.weight_decay=0",
                        "--optim.qk_clip_threshold=1e9"])
    topology = cpu_topology(rank, world_size, cfg)
    with build_trainer(cfg, topology) as parts:
        batches = _batches(cfg, topology, 0)
        train_step(parts, batches)
        before = parts.qk_clip.last[0]  # the first layer's heads: what clipping does to a layer changes the inputs
        parts.qk_clip.threshold = threshold = ((before.max() + before.min()) / 2).item()  # of the later ones
        train_step(parts, batches)
        parts.qk_clip.threshold = 1e9
        train_step(parts, batches)
        return before.tolist(), threshold, parts.qk_clip.last[0].tolist()


def _train(rank: int, world_size: int, layouts: dict, root: str, runs: dict[str, list[str]],
           caps: dict[str, list[str]]) -> dict:
    """Each layout's step losses (from the LM head's stage) and whole main weights after STEPS steps, then
    pretrain_gpt.py's `runs` (their errors under "errors"), then QK-clip's caps at each of the layouts `caps`."""
    out = {"errors": _pretrain(rank, world_size, root, runs),
           "caps": {name: _capped(rank, world_size, extra) for name, extra in caps.items()}}
    for name, extra in layouts.items():
        cfg = parse_config([*MUON, *extra])
        topology = cpu_topology(rank, world_size, cfg)
        with build_trainer(cfg, topology) as parts:
            losses = [train_step(parts, _batches(cfg, topology, s)).loss for s in range(STEPS)]
            out[name] = (losses, whole_shards(parts, topology, lambda shard: shard.main))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("muon")
    reference = run_ranks(1, _train, REFERENCES, str(root / "one"), {"uninterrupted": []},
                          {"dense": [], "latent": LATENT})[0]
    ranks = run_ranks(4, _train, {name: extra for name, (extra, _) in LAYOUTS.items()}, str(root), RUNS, CAPS)
    weights = {name: {k: v for rank in reversed(ranks) for k, v in rank[name][1].items()} for name in LAYOUTS}
    return {"one device": reference, "layouts": {name: (ranks[-1][name][0], weights[name]) for name in LAYOUTS},
            "errors": ranks[0]["errors"], "root": root, "caps": [reference["caps"]] + [r["caps"] for r in ranks]}


def test_qk_clip_logs_each_layers_largest_logit(runs):
    record = metrics(runs["root"] / "QK-clip at pp2 x tp2.jsonl")[0]
    logits = {key: value for key, value in record.items() if key.startswith("max_logit/")}
    assert sorted(logits) == [f"max_logit/layer_{i}" for i in range(4)] and all(v > 0 for v in logits.values())


@pytest.mark.parametrize("attention", sorted(CAPS))
def test_qk_clip_caps_the_heads_over_the_threshold_and_leaves_the_others(runs, attention):
    """One device and tp 2 x dp 2 (each rank its half of the heads): after the clipping step every head's largest
    logit (of the first layer) on the same batch is min(before, threshold), and there were heads on both sides;
    latent attention's too, whose rotary key, shared by the heads, is left alone (Kimi K2's rule)."""
    for before, threshold, after in (caps[attention] for caps in runs["caps"]):
        assert any(b > threshold * 1.01 for b in before) and any(b < threshold * 0.99 for b in before)
        assert after == pytest.approx([min(b, threshold) for b in before], rel=1e-4)


def test_muon_resumes_at_another_layout_as_if_never_stopped(runs):
    """Saved at tp2 SP x dp2 (distributed optimizer) after step 3, resumed at pp2 x tp2 and at ZeRO-3 over dp4:
    steps 4 and 5 are the uninterrupted one-device run's; Muon's momentum is in the checkpoint, layout-free."""
    root = runs["root"]
    uninterrupted = [r["loss"] for r in metrics(root / "one" / "uninterrupted.jsonl")]
    saved, *resumed = ([r["loss"] for r in metrics(root / f"{name}.jsonl")]
                       for name in ("saved", "resumed at pp2 x tp2", "resumed at ZeRO-3 over dp4"))
    assert len(uninterrupted) == 5 and saved == pytest.approx(uninterrupted[:3], rel=1e-5)
    for losses in resumed:
        assert losses == pytest.approx(uninterrupted[3:], rel=1e-5)


def test_switching_the_optimizer_on_resume_is_refused_unless_asked(runs):
    assert set(runs["errors"]) == {"adamw refused"}
    message = runs["errors"]["adamw refused"]
    assert "optim.optimizer=adamw here" in message and "--checkpoint.load_optimizer=false" in message
    assert len(metrics(runs["root"] / "adamw, fresh optimizer state.jsonl")) == 1  # step 4 of 4, from step 3


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_muon_at_every_layout_equals_one_device(runs, layout):
    losses, weights = runs["layouts"][layout]
    ref_losses, ref_weights = runs["one device"][LAYOUTS[layout][1]]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    if "QK-clip" in layout:  # the clip changed the weights: the unclipped run's differ
        unclipped = runs["one device"][LAYOUTS[layout][1].removesuffix(", QK-clip")][1]
        query = next(f"layers.0.attention.{p}.weight" for p in ("linear_qkv", "linear_q_up_proj")
                     if f"layers.0.attention.{p}.weight" in ref_weights)
        assert not torch.allclose(ref_weights[query], unclipped[query], rtol=1e-3, atol=0)
    for name, value in weights.items():
        # AdamW's steps (embedding, head, norms) turn rounding-level gradient differences into lr-sized ones
        # where a gradient is near zero (m / sqrt(v)): Muon's matrices are held to the tight tolerance.
        atol = 1e-6 if ".linear_" in name or "router" in name else 1e-3
        torch.testing.assert_close(value, ref_weights[name], rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _separate_update(rank: int, world_size: int, precision: str, scale: str) -> tuple[dict, dict, dict]:
    """One Muon step of a one-device MoE model from random gradients: the weights before, the gradients and the
    weights after, as HF tensors (transformers' separate matrices)."""
    cfg = parse_config([*MUON, *MOE, "--model.family=qwen3", f"--train.precision={precision}",
                        "--train.param_dtype=fp32", f"--optim.muon_scale={scale}", "--optim.weight_decay=0.1"])
    generator = torch.Generator().manual_seed(0)
    with build_trainer(cfg, cpu_topology(rank, world_size, cfg)) as parts:
        named = dict(parts.model.named_parameters())
        before = {n: p.detach().clone() for n, p in named.items()}
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in named.items()}
        for shard in parts.optimizer.shards():
            shard.main.grad = grads[shard.name].reshape(-1)[shard.start:shard.end].clone()
        parts.optimizer.step()
        after = {n: p.detach().clone() for n, p in named.items()}
        state = [t.clone() for s in parts.optimizer.optimizer.state.values() for t in s.values()]
        for shard in parts.optimizer.shards():  # a NaN gradient: the step leaves weights and state alone
            shard.main.grad = torch.full_like(shard.main, float("nan"))
        parts.optimizer.clip(1.0, torch.ones(()))
        parts.optimizer.step()
        kept = all(torch.equal(p, after[n]) for n, p in named.items()) and all(
            torch.equal(a, b) for a, b in zip(state, (t for s in parts.optimizer.optimizer.state.values()
                                                       for t in s.values())))
    return (*(to_hf(state, cfg.model) for state in (before, grads, after)), kept)


def _separate(name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The matrices transformers' released checkpoints store separately: each expert, its gate and up."""
    matrices = list(tensor.reshape(-1, *tensor.shape[-2:]))
    return [half for m in matrices for half in m.chunk(2)] if name.endswith("gate_up_proj") else matrices


def _reference(weight: torch.Tensor, grad: torch.Tensor, precision: str, scale: str) -> torch.Tensor:
    """torch.optim.Muon's first step on one matrix (bf16), or the same step with the iteration in fp32."""
    if precision == "bf16":
        p = torch.nn.Parameter(weight.clone())
        p.grad = grad.clone()
        torch.optim.Muon([p], lr=0.01, weight_decay=0.1, adjust_lr_fn=TORCH_SCALES[scale]).step()
        return p.detach()
    update = grad.lerp(torch.zeros_like(grad).lerp(grad, 0.05), 0.95)
    return weight * (1 - 0.01 * 0.1) - 0.01 * update_scale(*weight.shape, scale) * newton_schulz(update, 5,
                                                                                                   torch.float32)


TORCH_SCALES = {"rms": "match_rms_adamw", "spectral": "original"}
HIDDEN = ("_proj", "mlp.gate.weight", "experts.")


@pytest.mark.parametrize("precision, scale", [("bf16", "rms"), ("bf16", "spectral"), ("fp32", "rms")])
def test_one_device_update_is_torch_muon_on_the_separate_matrices(precision, scale):
    """QKV split into q, k, v (grouped-query), gate/up into two, each expert on its own, the router too; a step
    with a NaN gradient changes no weight and no optimizer state (decided on the device)."""
    before, grads, after, nan_step_kept_everything = run_ranks(1, _separate_update, precision, scale)[0]
    assert nan_step_kept_everything
    hidden = [n for n in before if any(part in n for part in HIDDEN)]
    assert any("k_proj" in n for n in hidden) and any("experts.gate_up_proj" in n for n in hidden)
    for name in hidden:
        expected = [_reference(w, g, precision, scale) for w, g in zip(_separate(name, before[name]),
                                                                        _separate(name, grads[name]))]
        for got, want in zip(_separate(name, after[name]), expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_muon_options_are_validated():
    cfg = parse_config([*MUON, "--optim.muon_momentum=1.0", "--optim.muon_ns_steps=0", "--optim.qk_clip_threshold=0"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, 1)
    assert error.value.problems == ["optim.muon_momentum=1.0 must be in [0, 1) (0.95 as released)",
                                    "optim.muon_ns_steps=0 must be in [1, 99] (5 as released)",
                                    "optim.qk_clip_threshold=0.0 must be positive (Kimi K2 uses 100) or unset"]
    cfg = parse_config([*MUON, "--model.family=qwen3", "--parallel.cp=2", "--optim.qk_clip_threshold=100"])
    with pytest.raises(ConfigError, match=r"optim.qk_clip_threshold does not work with q/k norms"):
        validate(cfg, 2)


def _plans(model: list[tuple[str, list[int], Placement]], grid: RankGrid, distributed: bool) -> list[MuonPlan]:
    """Every rank's plan for `model` (name, local shape, placement) laid out in one bucket per parameter."""
    data = DATA_AXES["dense"]
    replicas = math.prod(grid.size(axis) for axis in data)
    params = [(name, torch.empty(shape), placement) for name, shape, placement in model]
    ranges = [{name: (0, p.numel()) for name, p, _ in params} for _ in range(replicas)]
    if distributed:  # each data-parallel index owns its share of every parameter, as a bucket per parameter would
        ranges = [{name: (i * p.numel() // replicas, (i + 1) * p.numel() // replicas) for name, p, _ in params}
                  for i in range(replicas)]
    return [MuonPlan(params, {"dense": grid}, rank, {"dense": ranges}, distributed) for rank in range(grid.world_size)]


@pytest.mark.parametrize("distributed", [False, True])
def test_each_matrix_is_orthogonalised_once_by_one_of_its_holders_spread_over_the_stage(distributed):
    """tp2 x dp2 x pp2: every rank derives the same owners, each unit's owner holds a piece of it, the units of a
    stage spread over its four ranks (no rank gets twice the lightest one's work), each element travels once."""
    grid = RankGrid.dense(tp=2, dp=2, pp=2)
    model = [(f"layers.{i}.{kind}.weight", shape, placement) for i in range(4) for kind, shape, placement in (
        ("attention.linear_qkv", [48, 64], Placement.split("tp", 0)), ("attention.linear_proj", [64, 32],
                                                                       Placement.split("tp", 1)),
        ("mlp.linear_fc1", [128, 64], Placement.split("tp", 0, 2)), ("mlp.linear_fc2", [64, 64],
                                                                     Placement.split("tp", 1)))]
    plans = _plans(model, grid, distributed)
    for stage in grid.groups(("tp", "cp", "dp")):
        owners = {tuple((u.key, u.owner) for u in plans[rank].units) for rank in stage}
        assert len(owners) == 1
        units = plans[stage[0]].units
        assert all(u.owner in {p.rank for p in u.pieces} and u.owner in stage for u in units)
        load = {rank: sum(u.cost for u in units if u.owner == rank) for rank in stage}
        assert max(load.values()) < 2 * min(load.values())
        for unit in units:
            sent = sum(p.hi - p.lo for p in unit.pieces if p.sends)
            assert sent == math.prod(unit.shape)


def test_fused_weights_split_into_transformers_matrices_or_heads():
    """The QKV rows of 2 KV groups of 2 query heads each (head size 2: [g0: q q k v][g1: q q k v]) are q, k, v as
    transformers stores them, or each head with optim.muon_split_heads; gate/up (two blocks) two halves."""
    qkv = Placement(Placement.split("tp", 0).shards, fused=Fused(2, (2, 1, 1), heads=True))
    rows = [t.tolist() for t in qkv.separate_rows([16, 8], per_head=False)]
    assert rows == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    heads = [t.tolist() for t in qkv.separate_rows([16, 8], per_head=True)]
    assert sorted(heads) == [[i, i + 1] for i in range(0, 16, 2)]
    assert [t.tolist() for t in Placement.split("etp", 1, 2).separate_rows([4, 6, 8], False)] == [[0, 1, 2], [3, 4, 5]]
    assert Placement.split("tp", 1).separate_rows([4, 6], False) is None


def test_routers_take_muon_unless_asked_not_to():
    cfg = parse_config([*MUON, *MOE])
    model = GPTModel(cfg.model, torch.device("meta"), seed=0)
    with_routers, without = model.hidden_matrices(routers=True), model.hidden_matrices(routers=False)
    assert with_routers - without == {"layers.1.mlp.router.weight", "layers.2.mlp.router.weight",
                                      "layers.3.mlp.router.weight"}
    assert "layers.1.mlp.experts.linear_fc1.weight" in without and "layers.0.attention.linear_qkv.weight" in without
    assert not any(name.startswith(("embedding", "lm_head")) or "norm" in name for name in with_routers)


def test_the_dry_run_steps_muon_under_nccl_rules():
    """Each role's rank of tp2 SP x pp2 x dp2 (distributed optimizer, bf16) stepped on fake tensors at world size
    8 obeys NCCL's rules. (What the update makes counts as optimizer state there: with Muon that includes the
    owners' whole matrices and the iteration's temporaries, which the planner does not count yet.)"""
    cfg = measurement_config(8, model={"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                       "num_query_groups": 2, "seq_length": 32, "vocab_size": 256},
                             parallel={"tp": 2, "pp": 2, "sequence_parallel": True, "distributed_optimizer": True},
                             train={"micro_batch_size": 2, "global_batch_size": 8, "precision": "bf16",
                                    "param_dtype": "bf16"}, optim={"optimizer": "muon"})
    report = dry_run(cfg, 8, "peak")
    assert report.ok and len(report.ranks) == 2


def test_each_expert_is_a_matrix_of_its_own_owned_at_its_ep_coordinate():
    """ep2 x etp2 (world 4): the two experts each ep rank holds (split over etp, gate/up blocks) are four units,
    each owned by one of the two ranks holding it, the two of an ep rank by different ranks."""
    grids = {"dense": RankGrid.dense(dp=4), "expert": RankGrid.expert(etp=2, ep=2)}
    placement = Placement((("ep", ShardSpec(0)), ("etp", ShardSpec(1, 2))), "expert")
    param = ("layers.1.mlp.experts.linear_fc1.weight", torch.empty(2, 32, 16), placement)
    plans = [MuonPlan([param], grids, rank, {"expert": [{param[0]: (0, param[1].numel())}]}, False)
             for rank in range(4)]
    units = plans[0].units
    assert [u.key[1:] for u in units] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # (ep coordinate, local expert)
    for unit in units:
        holders = {p.rank for p in unit.pieces}
        assert holders == {r for r in range(4) if grids["expert"].coords(r)["ep"] == unit.key[1]}
        assert unit.shape == [64, 16] and sum(p.hi - p.lo for p in unit.pieces if p.sends) == 64 * 16
    assert units[0].owner != units[1].owner and units[2].owner != units[3].owner
