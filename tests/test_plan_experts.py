"""The planner's mixture-of-experts figures against what megalite really allocates: parameter counts per rank grid
of models built on the meta device (read through their placements), model-state bytes measured after a training
step at ep 1, 2 and 4 (planning/measure.py rank_memory, as tools/memory_report.py reports them), the bytes an MoE
block's autograd keeps (one device, and summed over expert-parallel ranks), and the plan's report."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks

from megalite.config import TORCH_DTYPES, Config
from megalite.config_cli import apply_mapping
from megalite.config_validation import validate
from megalite.dryrun.report import TOLERANCE, difference, format_dry_run
from megalite.dryrun.run import dry_run
from megalite.model.gpt import GPTModel
from megalite.parallel.context import AxisView, ParallelContext
from megalite.parallel.pipeline.registry import stage_layout
from megalite.parallel.zero import unit_index
from megalite.planning.activations import Widths, moe_block_bytes, token_rows
from megalite.planning.experts import comm_bytes, fp8_padding_rows
from megalite.planning.measure import MEASUREMENT, measurement_config, rank_memory, saved_storages
from megalite.planning.memory import chunk_activation_bytes, gathered_bytes, grid_replicas, stage_memory
from megalite.planning.parameters import active_parameters, model_parameters, rank_parameters
from megalite.planning.plan import format_plan, make_plan
from megalite.training.build import build_model, build_trainer
from megalite.training.step import precision_context

MOE = {"num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 48, "moe_shared_expert_size": 32,
       "moe_shared_expert_gate": True, "moe_first_dense_layers": 1}


def moe_config(family: str = "llama", model: dict | None = None, **sections: dict) -> Config:
    """tiny_config with four layers, the first dense, the others mixtures of experts."""
    cfg = tiny_config(family, model={**MOE, **(model or {})}, **sections)
    cfg.model.num_layers = 4
    return cfg


def grid_counts(model: GPTModel) -> dict[str, int]:
    """Elements of the model's parameters on each rank grid, as their placements say."""
    placements, counts = model.placements_by_name(), {"dense": 0, "expert": 0}
    for name, param in model.named_parameters():
        counts[placements[name].grid] += param.numel()
    return counts


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tp,ep,pp", [(1, 1, 1), (2, 2, 1), (1, 4, 2), (2, 8, 2)])
def test_parameter_counts_per_grid_equal_the_built_model(family, tp, ep, pp):
    cfg = moe_config(family, parallel={"tp": tp, "ep": ep, "pp": pp, "sequence_parallel": tp > 1})
    for pp_rank in range(pp):
        ctx = ParallelContext(tp=AxisView(None, 0, tp), ep=AxisView(None, 0, ep), sequence_parallel=tp > 1)
        model = GPTModel(cfg.model, torch.device("meta"), ctx, stage_layout(cfg, pp_rank), seed=0)
        params = rank_parameters(cfg, pp_rank)
        assert params.by_grid == grid_counts(model)
        assert params.largest == max(p.numel() for p in model.parameters())
        units = unit_index(model.chunk_modules())
        sizes = [sum(p.numel() for p in model.parameters() if units[id(p)] == u) for u in sorted(set(units.values()))]
        assert params.units == tuple(sizes)


def test_total_and_active_parameters():
    """Active: the model less, per MoE layer, the 6 experts a token skips (each 3 x 64 x 48 weights)."""
    cfg = moe_config()
    built = sum(p.numel() for p in GPTModel(cfg.model, torch.device("meta"), seed=0).parameters())
    assert model_parameters(cfg.model) == built
    assert active_parameters(cfg.model) == built - 3 * 6 * 3 * 64 * 48
    dense = moe_config(model={"num_experts": 0})
    assert active_parameters(dense.model) == model_parameters(dense.model)


def test_expert_state_is_sharded_over_edp():
    """World 16, tp 2, pp 2: the dense parts' replicas are dp 4; ep 2 leaves edp 4 for the experts, ep 8 leaves 1."""
    cfg = moe_config(parallel={"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True, "distributed_optimizer": True},
                     train={"precision": "bf16", "param_dtype": "bf16", "global_batch_size": 8})
    validate(cfg, 16)
    assert grid_replicas(cfg, 16) == {"dense": 4, "expert": 4}
    cfg.parallel.ep = 8
    assert grid_replicas(cfg, 16) == {"dense": 4, "expert": 1}
    stage = stage_memory(cfg, 16, 1)
    dense, experts = stage.parameters.by_grid["dense"], stage.parameters.expert
    assert stage.expert_state == experts * 18  # ZeRO-1 over one expert replica: nothing sharded
    assert stage.state == pytest.approx(dense * (6 + 12 / 4) + experts * 18)


@pytest.mark.parametrize("ep,zero", [(1, 1), (2, 1), (4, 1), (2, 3)])
def test_model_state_matches_measured_tensors(ep, zero):
    """Four ranks, dp 4: the experts' main weights and Adam state are sharded over edp = 4/ep, the rest over dp;
    at ZeRO-3 the whole units gathered at once too. The experts hold most of the parameters, so sharding them
    over the wrong ranks misses by far more than the 10% bucket padding allowed."""
    cfg = moe_config(model={"moe_ffn_hidden_size": 128, "moe_first_dense_layers": 0},
                     parallel={"ep": ep, "distributed_optimizer": True, "zero_stage": zero},
                     train={"precision": "bf16", "param_dtype": "bf16", "global_batch_size": 8})
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size = 2, 128, 1000
    validate(cfg, 4)
    for measured in run_ranks(4, rank_memory, cfg):
        planned = stage_memory(cfg, 4, 0, "cpu")
        assert measured["numel"] == planned.parameters.total
        for key, value in (("params", planned.weights), ("grads", planned.gradients), ("main", planned.main_weights),
                           ("state", planned.optimizer)):
            assert measured[key] == pytest.approx(value, rel=0.1, abs=4096), key
        assert measured["gathered"] == pytest.approx(gathered_bytes(cfg, planned.parameters, 4)[0], rel=0.001)


PRECISIONS = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]  # (train.precision, train.param_dtype)


def block_config(precision: str, param_dtype: str, model: dict | None = None, **parallel) -> Config:
    """One MoE layer (64-token sequences, micro batch 2) in the given precision."""
    cfg = moe_config(model={"moe_first_dense_layers": 0, **(model or {})}, parallel=parallel,
                     train={"precision": precision, "param_dtype": param_dtype, "global_batch_size": 4})
    cfg.model.num_layers, cfg.model.seq_length = 1, 64
    return cfg


def block_saved_bytes(model: GPTModel, cfg: Config, seed: int = 0) -> int:
    """Bytes autograd keeps for one micro batch through layer 0's MoE block (its input from the norm before it)."""
    layer, mbs = model.layers["0"], cfg.train.micro_batch_size
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(token_rows(cfg)[1] // mbs, mbs, cfg.model.hidden_size, generator=generator)
    with precision_context(cfg.train.precision, torch.device("cpu")):
        normed = layer.pre_mlp_norm(x.to(TORCH_DTYPES[cfg.train.param_dtype]))
        model.aux_losses.start_step(1.0, torch.device("cpu"))
        with saved_storages(model) as seen:
            layer.mlp(normed)
    return sum(seen.values())


def planned_block_bytes(cfg: Config) -> int:
    return moe_block_bytes(cfg, token_rows(cfg)[1], Widths.of(cfg, "cpu"))


FEATURES = [{}, {"gated_mlp": False}, {"moe_shared_expert_size": 0}, {"moe_shared_expert_gate": False},
            {"moe_z_loss_coeff": 0.001, "moe_aux_loss_coeff": 0.01}, {"moe_norm_topk_prob": False}]


@pytest.mark.parametrize("precision,param_dtype", PRECISIONS)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f) or "default")
def test_moe_block_activations_to_the_byte(precision, param_dtype, features):
    """Everything but the grouped GEMM's int32 offsets and the balancing losses' per-expert counts (a few
    bytes per expert), in every precision: the router's fp32 input, scores and choices, the sort, the rows, the experts'
    intermediates (and their weights cast to bf16 when the parameters are fp32), the fp32 combine, the shared
    expert and its gate."""
    cfg = block_config(precision, param_dtype, features)
    validate(cfg, 1)
    model = build_model(cfg, torch.device("cpu"), ParallelContext(), 0).train()
    assert block_saved_bytes(model, cfg) == pytest.approx(planned_block_bytes(cfg), abs=16 * 8)


GPT_OSS_EXPERTS = {"activation": "quick_gelu", "glu_limit": 7.0, "glu_linear_offset": 1.0, "bias": True}


@pytest.mark.parametrize("precision,param_dtype", PRECISIONS)
@pytest.mark.parametrize("model,recompute", [({}, "selective"), (GPT_OSS_EXPERTS, "none"),
                                             (GPT_OSS_EXPERTS, "selective")],
                         ids=["selective", "gpt-oss", "gpt-oss,selective"])
def test_expert_activations_under_selective_recompute_and_clamped_quick_gelu(precision, param_dtype, model, recompute):
    """As above, where the experts' declaration reads its features and recompute flag (model/moe/experts.py):
    selective recompute keeps only fc1's output of the activation's tensors; gpt-oss's clamped quick-GELU GLU with
    an offset keeps the clamped gate, the offset up and the sigmoid besides, and its biases add nothing."""
    cfg = block_config(precision, param_dtype, model)
    cfg.train.recompute = recompute
    validate(cfg, 1)
    built = build_model(cfg, torch.device("cpu"), ParallelContext(), 0).train()
    assert block_saved_bytes(built, cfg) == pytest.approx(planned_block_bytes(cfg), abs=16 * 8)


def test_moe_model_activations_match_saved_tensors():
    """The whole chunk (a dense first layer, three MoE layers, embedding and head), as the dense tests measure it."""
    cfg = moe_config(train={"precision": "bf16", "param_dtype": "bf16"})
    model = build_model(cfg, torch.device("cpu"), ParallelContext(), 0).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length))
    with saved_storages(model) as seen, precision_context("bf16", torch.device("cpu")):
        model(tokens, tokens)
    assert sum(seen.values()) == pytest.approx(chunk_activation_bytes(cfg, 0, "cpu")[0], rel=0.05)


def _parallel_blocks(rank: int, world_size: int, configs: list[Config]) -> list[tuple[int, int]]:
    torch.set_num_threads(1)
    found = []
    for cfg in configs:
        with build_trainer(cfg, cpu_topology(rank, world_size, cfg)) as parts:
            found.append((block_saved_bytes(parts.model.train(), cfg, seed=rank), planned_block_bytes(cfg)))
    return found


EXPERT_PARALLEL = {"ep2 all-to-all": {"ep": 2}, "ep2 all-gather": {"ep": 2, "moe_dispatcher": "allgather"},
                   "tp2 SP x ep2": {"tp": 2, "sequence_parallel": True, "ep": 2}}


def test_moe_block_activations_under_expert_parallelism():
    """Which rank's experts run how many rows depends on the routing, but the ranks together run every row
    once (all-to-all) or ep times (all-gather, masked): summed over the two ranks, the plan is exact to the
    same few dozen bytes."""
    configs = [block_config("bf16", "fp32", **parallel) for parallel in EXPERT_PARALLEL.values()]
    for cfg in configs:
        validate(cfg, 2)
    ranks = run_ranks(2, _parallel_blocks, configs)
    for name, per_rank in zip(EXPERT_PARALLEL, zip(*ranks)):
        measured, planned = (sum(values) for values in zip(*per_rank))
        assert measured == pytest.approx(planned, abs=128), name


def test_dispatch_traffic():
    """Per MoE layer and micro batch, tokens = 64 x 2 routed on each rank, k = 2, hidden 64, bf16: the all-to-all
    sends the 3/4 of the 256 rows bound for other ranks' experts out and back; all-gather sends 3 blocks of the
    tokens (with fp32 weights and int64 ids) and reduce-scatters as much back."""
    cfg = block_config("bf16", "bf16", ep=4)
    tokens = token_rows(cfg)[1]
    assert tokens == 128
    rows = 2 * 256 * 3 // 4 * 64 * 2
    assert comm_bytes(cfg, tokens) == (rows, rows)
    cfg.train.recompute = "full"
    assert comm_bytes(cfg, tokens) == (rows, 2 * rows)
    cfg.train.recompute, cfg.parallel.moe_dispatcher = "none", "allgather"
    hidden = 2 * 3 * 128 * 64 * 2
    assert comm_bytes(cfg, tokens) == (hidden + 3 * 256 * 12, hidden + 3 * 256 * 4)
    cfg.parallel.ep = 1
    assert comm_bytes(cfg, tokens) == (0, 0)


def test_moe_lines_in_the_plan():
    cfg = moe_config(parallel={"ep": 4, "distributed_optimizer": True},
                     train={"precision": "bf16", "param_dtype": "bf16", "global_batch_size": 16})
    validate(cfg, 8)
    text = format_plan(make_plan(cfg, 8))
    assert f"{active_parameters(cfg.model) / 1e9:.3f} B active per token" in text
    assert "mixture of experts: 3 of 4 layers, 8 experts 48 wide, top 2, shared expert 32 wide" in text
    assert "; ep 4 x edp 2 (2 experts per GPU" in text
    assert "expert dispatch: all-to-all, 128 rows per GPU per layer per micro batch" in text
    forward, backward = comm_bytes(cfg, 64)
    assert f"{forward / 2**20:.1f} MiB sent per GPU per layer (forward), {backward / 2**20:.1f} MiB" in text
    assert "the experts' " in text and "replicated over edp 2, the dense parts over dp x cp 8" in text
    dense = moe_config(model={"num_experts": 0})
    validate(dense, 2)
    assert not {"active", "experts"} & set(format_plan(make_plan(dense, 2)).replace(",", " ").split())


def test_fp8_expert_padding_in_the_plan():
    """FP8 pads each local expert's rows to its kernel's alignment on CUDA (16 for torch._scaled_grouped_mm and the
    tensorwise kernel, 128 for blockwise tiles): the planner counts one block per local expert as the worst case,
    the bound parallel/fp8/grouped_kernel.pad_groups allocates (tests/test_fp8_kernels.py), and the plan says it."""
    cfg = moe_config(parallel={"ep": 4}, train={"global_batch_size": 16})
    assert fp8_padding_rows(cfg, 128) == 0
    for recipe, rows in (("tensorwise", 32), ("rowwise", 32), ("blockwise", 256)):
        cfg.train.fp8_recipe = recipe
        assert fp8_padding_rows(cfg, 128) == rows, recipe  # 2 experts per GPU, 128 rows already aligned
    cfg.train.fp8_recipe = "rowwise"
    assert fp8_padding_rows(cfg, 130) == 46  # 130 + 32 rounded up to 16 = 176
    validate(cfg, 8)
    text = format_plan(make_plan(cfg, 8))
    assert "FP8 (rowwise) pads each expert's rows to 16: up to 32 more rows per GPU per layer" in text


def test_the_moe_combines_backward_gradients_are_planned():
    """In an MoE layer's backward the combine's weighting (model/moe/dispatch.py) holds three fp32 [routed rows,
    hidden] gradients at once, the index_add having freed the weighted copy it kept: with wide rows and top 4 of 4
    they are a stage's transient peak, with and without recompute, and the planner counts them."""
    for recompute in ("none", "full"):
        tiny = {"model": {"family": "llama", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                          "num_query_groups": 2, "seq_length": 64, "vocab_size": 256, "num_experts": 4,
                          "moe_topk": 4, "moe_ffn_hidden_size": 32},
                "parallel": {"pp": 2, "distributed_optimizer": True},
                "train": {"micro_batch_size": 2, "global_batch_size": 4, "precision": "bf16", "param_dtype": "bf16",
                          "recompute": recompute}}
        cfg = measurement_config(2, **tiny)
        apply_mapping(cfg, MEASUREMENT, "dry run")
        report = dry_run(cfg, 2, 1)
        gradient = 2 * 64 * 4 * 256 * 4  # [tokens x top-k, hidden] in fp32
        for run in report.ranks:
            plan = report.plan(run)
            assert run.memory["transient"] >= 3 * gradient, recompute
            assert plan.transient >= 2 * gradient, recompute
            assert abs(difference(run, plan)) <= TOLERANCE, (recompute, format_dry_run(report, "h100"))
