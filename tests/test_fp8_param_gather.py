"""FP8 parameter gathers (train.fp8_param_gather, parallel/fp8/param_gather.py): at dp 2 under the distributed
optimizer and ZeRO-3, tensorwise and blockwise, in fp32 and in bf16 (blockwise's bf16 under the distributed
optimizer only), and at tp 2 x dp 2, under ZeRO-2, with overlapped gathers and with experts, a run whose linears'
and experts' weights are all-gathered as FP8 bytes gives the losses and the weights of the run that gathers them
in their dtype, bit for bit (both quantise the same values with the same scales); the data-parallel all-gathers
move one byte per FP8 weight element, as the planner counts; every collective passes the NCCL-rule replay;
checkpoints resume with the switch flipped; the validator names what it needs."""

from __future__ import annotations

import pytest
import torch
from distributed import cpu_topology, metrics, pretrain_each, run_ranks
from parity import train_and_gather, whole_shards

from megalite.config import ConfigError
from megalite.config_cli import parse_config
from megalite.config_validation import validate
from megalite.dryrun.nccl_rules.record import CommRecorder
from megalite.dryrun.nccl_rules.replay import replay
from megalite.parallel.context import ParallelContext
from megalite.parallel.fp8.param_gather import encode_slice, gathered_weights, slice_amax
from megalite.parallel.fp8.quantize import E4M3, LOCAL_AMAX, Scaling, amax_to_scale, quantize
from megalite.planning.memory import gathered_bytes, grid_replicas, stage_memory
from megalite.planning.parameters import rank_parameters
from megalite.planning.traffic import data_parallel, fp8_gathered, gradient_buffers
from megalite.training.build import build_model
from megalite.training.run_summary import fp8_line

# Two layers of a Llama; under blockwise every per-rank width tiles into 128 x 128 blocks, 128 tokens a micro
# batch, and the data-parallel slices of the buckets cut blocks (checked below). Adam with eps 1 steps about
# lr * gradient.
BASE = ["--model.family=llama", "--model.num_layers=2", "--model.num_attention_heads=2",
        "--model.num_query_groups=2", "--model.vocab_size=256", "--train.micro_batch_size=1",
        "--train.global_batch_size=2", "--optim.lr=1e-3", "--optim.adam_eps=1.0", "--optim.clip_grad=0",
        "--data.mock=true", "--train.device=cpu"]
SHAPES = {"blockwise": ["--model.hidden_size=256", "--model.ffn_hidden_size=512", "--model.seq_length=128",
                        "--model.moe_ffn_hidden_size=128"],
          "tensorwise": ["--model.hidden_size=64", "--model.ffn_hidden_size=128", "--model.seq_length=32",
                         "--model.moe_ffn_hidden_size=64"]}
EXPERTS = ["--model.num_experts=4", "--model.moe_topk=2", "--model.moe_first_dense_layers=1"]
LAYOUTS = {"distributed optimizer": ["--parallel.distributed_optimizer=true"],
           "ZeRO-3": ["--parallel.zero_stage=3"],
           "ZeRO-2": ["--parallel.zero_stage=2"],
           "experts x distributed optimizer": [*EXPERTS, "--parallel.distributed_optimizer=true"],
           "experts x ZeRO-3": [*EXPERTS, "--parallel.zero_stage=3"],
           "distributed optimizer, overlapped gathers": ["--parallel.distributed_optimizer=true",
                                                         "--parallel.overlap_param_gather=true"],
           "tp2 x distributed optimizer": ["--parallel.tp=2", "--parallel.distributed_optimizer=true"],
           "tp2 x ZeRO-3": ["--parallel.tp=2", "--parallel.zero_stage=3"]}
PRECISIONS = {"fp32": ["--train.precision=fp32"], "bf16": ["--train.precision=bf16", "--train.param_dtype=bf16"]}
TWO_RANKS = [(recipe, precision, layout) for recipe in ("tensorwise", "blockwise") for precision in PRECISIONS
             for layout in ("distributed optimizer", "ZeRO-3")
             if (recipe, precision, layout) != ("blockwise", "bf16", "ZeRO-3")]  # bf16 matmuls are slow on a CPU
TWO_RANKS += [("tensorwise", "fp32", "ZeRO-2"), ("tensorwise", "fp32", "distributed optimizer, overlapped gathers"),
              ("tensorwise", "fp32", "experts x ZeRO-3"), ("blockwise", "fp32", "experts x distributed optimizer")]
FOUR_RANKS = [("tensorwise", "fp32", "tp2 x distributed optimizer"), ("blockwise", "fp32", "tp2 x ZeRO-3")]
CASES = TWO_RANKS + FOUR_RANKS


def _args(case: tuple[str, str, str], gather: bool) -> list[str]:
    recipe, precision, layout = case
    return [*BASE, *SHAPES[recipe], *PRECISIONS[precision], *LAYOUTS[layout], f"--train.fp8_recipe={recipe}",
            f"--train.fp8_param_gather={str(gather).lower()}"]


def _cut_blocks(layout, bucket) -> int:
    """How many 128-row bands of the bucket's weights the data-parallel slices' boundaries cut (blocks that
    straddle two ranks' slices, whose amax the ranks agree on)."""
    cuts = 0
    for rank in range(1, layout.replicas):
        first = bucket.shard(rank, layout.replicas)[0]
        for param in bucket.params:
            start, end = layout.offsets[id(param)]
            cuts += start < first < end and (first - start) % (128 * param.shape[-1]) != 0
    return cuts


def _data_parallel_gathers(record) -> list[tuple[str, int]]:
    """(dtype, bytes received) of each all-gather this rank posted over the (expert-)data-parallel group."""
    return [(call.dtype, call.payload) for call in record.calls
            if "gather" in call.name and call.desc in ("data-parallel", "expert-data-parallel")]


def _run(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> list:
    """Each case without and with FP8 gathers: (each step's loss and whole main weights, the data-parallel
    all-gathers, the buckets (elements, FP8 or not), the NCCL-rule record) of each."""
    results = []
    for case in cases:
        pair = []
        for gather in (False, True):
            cfg = parse_config(_args(case, gather))
            buckets = []
            with CommRecorder(rank) as recorder:
                steps, _ = train_and_gather(cfg, cpu_topology(rank, world_size, cfg), steps=2,
                                            record=lambda parts, result, buckets=buckets: _step(parts, result, buckets))
            pair.append((steps, _data_parallel_gathers(recorder.record), buckets, recorder.record))
        results.append(pair)
    return results


def _step(parts, result, buckets: list) -> tuple[float, dict[str, torch.Tensor]]:
    buckets[:] = [(b.end - b.start, b.fp8, _cut_blocks(buffer.layout, b))
                  for buffer in parts.grads.buffers for b in buffer.layout.buckets]
    return result.loss, whole_shards(parts, parts.topology, lambda m: m.main.clone())


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str, str], list]:
    """Each case's results, one per rank: the two-rank cases in one spawned group, the four-rank ones in another."""
    results = {}
    for cases, world in ((TWO_RANKS, 2), (FOUR_RANKS, 4)):
        per_rank = run_ranks(world, _run, cases, observed_groups=True)
        results |= {case: [ranks[i] for ranks in per_rank] for i, case in enumerate(cases)}
    return results


@pytest.mark.parametrize("case", CASES, ids=" ".join)
def test_fp8_gathers_equal_the_run_without_them_bit_for_bit(runs, case):
    """Every step's loss and every main weight after it equal the run that gathers the weights in their dtype,
    bit for bit; the collectives pass the NCCL-rule replay. (Clipping is off: the norm sums the same squares in
    another order, since FP8 weights have buckets of their own, so a clip factor could differ in its last bit.)"""
    if case[0] == "blockwise":
        assert any(cuts for (*_, buckets, _) in (pair[1] for pair in runs[case]) for *_, cuts in buckets)
    for (plain, *_), (fp8, *_) in runs[case]:
        for step, ((loss, weights), (fp8_loss, fp8_weights)) in enumerate(zip(plain, fp8)):
            assert fp8_loss == loss, (case, step)
            assert weights.keys() == fp8_weights.keys()
            for name, weight in weights.items():
                assert torch.equal(fp8_weights[name], weight), (case, step, name)
    for gather in (0, 1):
        report = replay([pair[gather][3] for pair in runs[case]])
        assert report.ok and report.calls > 0, report.text()


@pytest.mark.parametrize("case", CASES, ids=" ".join)
def test_fp8_buckets_gather_one_byte_per_element(runs, case):
    """With the switch on, every data-parallel all-gather of an FP8 weights' bucket moves one byte per element
    (uint8), half of bf16's bytes and a quarter of fp32's, and the other buckets move their parameters' dtype;
    without it every bucket moves the parameters' dtype."""
    itemsize = 2 if case[1] == "bf16" else 4
    dtype = "torch.bfloat16" if itemsize == 2 else "torch.float32"
    for (_, plain, plain_buckets, _), (_, fp8, buckets, _) in runs[case]:
        assert {call[0] for call in plain} == {dtype} and not any(is_fp8 for _, is_fp8, _ in plain_buckets)
        fp8_sizes = {size for size, is_fp8, _ in buckets if is_fp8}
        other_sizes = {size * itemsize for size, is_fp8, _ in buckets if not is_fp8}
        assert fp8_sizes and {call[0] for call in fp8} == {"torch.uint8", dtype}
        assert {nbytes for kind, nbytes in fp8 if kind == "torch.uint8"} == fp8_sizes
        assert {nbytes for kind, nbytes in fp8 if kind == dtype} <= other_sizes
        assert sum(nbytes for _, nbytes in fp8) < sum(nbytes for _, nbytes in plain)


@pytest.mark.parametrize("case", [case for case in CASES if "ZeRO-3" not in case[2]], ids=" ".join)
def test_planner_counts_the_gathered_bytes(runs, case):
    """The planner's data-parallel all-gather bytes of a step (planning/traffic.py) are what the distributed
    optimizer's runs gathered in each of their two steps (after the FP8 copies of the initial weights, gathered
    at build), with the switch on as without."""
    for gather, (_, gathers, buckets, _) in zip((False, True), runs[case][0]):
        cfg = parse_config(_args(case, gather))
        world = 4 if case in FOUR_RANKS else 2
        replicas = grid_replicas(cfg, world)
        planned = data_parallel(cfg, gradient_buffers(cfg, world, 0), replicas, cfg.num_microbatches(world),
                                fp8_gathered(cfg, 0, replicas))
        step = sum(call.payload for call in planned if call.call == "all_gather")
        at_build = sum(size for size, is_fp8, _ in buckets if is_fp8)
        assert sum(nbytes for _, nbytes in gathers) == 2 * step + at_build, (case, gather)
    plain, fp8 = (parse_config(_args(case, gather)) for gather in (False, True))
    assert stage_memory(fp8, 2, 0).weights > stage_memory(plain, 2, 0).weights  # the FP8 copies, at stages 1-2


def test_planner_counts_zero3_units_gathered_in_fp8():
    """Under ZeRO-3 the planner's whole units hold the FP8-gathered weights as one byte per element, and each
    rank keeps their FP8 slice."""
    for precision, itemsize in (("fp32", 4), ("bf16", 2)):
        plain, fp8 = (parse_config(_args(("blockwise", precision, "ZeRO-3"), gather)) for gather in (False, True))
        params = rank_parameters(fp8, 0)
        assert params.fp8[0] == sum(params.fp8_units) > 0 == params.fp8[1]
        saved = gathered_bytes(plain, rank_parameters(plain, 0), 2)[0] - gathered_bytes(fp8, params, 2)[0]
        assert 0 < saved <= params.fp8[0] * (itemsize - 1)
        assert stage_memory(fp8, 2, 0).weights == stage_memory(plain, 2, 0).weights + params.fp8[0] / 2


@pytest.mark.parametrize(("shape", "tile"), [((200, 192), (128, 128)), ((96, 40), (96, 40)), ((6 * 40, 24), (40, 24))])
def test_slices_quantise_to_the_whole_weights_bytes(shape, tile):
    """A weight cut into ranks' flat slices anywhere (mid-row, mid-block; partial blocks; a grouped weight's
    experts stacked, one tensorwise tile each): the MAX of the slices' tile amaxes is the whole weight's, and each
    slice encoded with the agreed scales is the whole weight's FP8 bytes."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.rand(shape[0], 1) * 10
    reference = quantize(weight, Scaling(E4M3, *tile), True, LOCAL_AMAX, "weight", "forward")
    cuts = [0, 1000, 1001, shape[0] * shape[1] * 2 // 3 + 7, shape[0] * shape[1]]
    amax = torch.zeros_like(reference.scale)
    for lo, hi in zip(cuts, cuts[1:]):
        first, part = slice_amax(weight.view(-1)[lo:hi], lo, hi, shape, tile)
        amax[first:first + part.shape[0]] = torch.maximum(amax[first:first + part.shape[0]], part)
    scale = amax_to_scale(amax, E4M3, True)
    assert torch.equal(scale.reciprocal(), reference.scale)
    data = torch.cat([encode_slice(weight.view(-1)[lo:hi], lo, hi, shape, tile, scale, E4M3)
                      for lo, hi in zip(cuts, cuts[1:])])
    assert torch.equal(data.view(torch.uint8), reference.data.reshape(-1).view(torch.uint8))


def _problems(*args: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(parse_config([*BASE, *SHAPES["tensorwise"], *args]), 2)
    return str(err.value)


def test_validator_names_what_fp8_param_gather_needs():
    for recipe in ("tensorwise", "blockwise"):
        for layout in ("--parallel.distributed_optimizer=true", "--parallel.zero_stage=2", "--parallel.zero_stage=3"):
            validate(parse_config([*_args((recipe, "bf16", "ZeRO-3"), True), layout]), 2)
    assert "but train.fp8_recipe=none; set train.fp8_recipe=tensorwise" in _problems("--train.fp8_param_gather=true")
    rowwise = _problems("--train.fp8_recipe=rowwise", "--train.fp8_param_gather=true",
                        "--parallel.distributed_optimizer=true")
    assert "cannot gather train.fp8_recipe=rowwise's weights in FP8" in rowwise and "tensorwise or blockwise" in rowwise
    no_zero = _problems("--train.fp8_recipe=tensorwise", "--train.fp8_param_gather=true")
    assert "parallel.zero_stage is 0; set parallel.distributed_optimizer=true" in no_zero
    line = fp8_line(parse_config(_args(("blockwise", "fp32", "ZeRO-3"), True)))
    assert "weights all-gathered in FP8 (train.fp8_param_gather)" in line


def test_checkpoints_resume_with_the_switch_flipped(tmp_path):
    """Checkpoints hold the high-precision weights, whatever was gathered: a ZeRO-3 run saved with FP8 gathers
    resumes without them, and one saved without resumes with them, each continuing the uninterrupted run's
    losses bit for bit."""
    case = ("tensorwise", "fp32", "ZeRO-3")
    logs = ["--logging.progress_bar=false", "--logging.log_interval=1", "--data.num_workers=0",
            "--train.train_iters=4"]

    def run(name: str, gather: bool, *extra: str) -> list[str]:
        ckpt = f"--checkpoint.save={tmp_path / name[:-1]}"  # "on1" saves where "on2" loads
        return [*_args(case, gather), *logs, ckpt, f"--logging.metrics_file={tmp_path / name}.jsonl", *extra]

    runs = [run("whole", False), run("on1", True, "--train.exit_interval=2"), run("on2", False),
            run("off1", False, "--train.exit_interval=2"), run("off2", True)]
    run_ranks(2, pretrain_each, runs)
    losses = {name: [r["loss"] for r in metrics(tmp_path / f"{name}.jsonl")] for name in ("whole", "on1", "on2",
                                                                                           "off1", "off2")}
    assert len(losses["whole"]) == 4
    assert losses["on1"] + losses["on2"] == losses["whole"]
    assert losses["off1"] + losses["off2"] == losses["whole"]


def test_the_head_gathers_in_fp8_only_when_its_weight_is_its_own():
    """Under train.fp8_output_head the LM head's weight is gathered in FP8 when the head owns it (llama), not when
    it is the tied embedding's (gpt2: the lookup reads it whole); the layers' linears are gathered either way."""

    for family, head_in_fp8 in (("llama", True), ("gpt2", False)):
        cfg = parse_config([*BASE, *SHAPES["tensorwise"], f"--model.family={family}", "--train.fp8_recipe=tensorwise",
                            "--train.fp8_output_head=true", "--train.fp8_param_gather=true",
                            "--parallel.distributed_optimizer=true"])
        validate(cfg, 2)
        model = build_model(cfg, torch.device("meta"), ParallelContext(), 0)
        gathered = gathered_weights(model)
        names = {name for name, p in model.named_parameters() if id(p) in gathered}
        assert any(name.startswith("layers.") for name in names), family
        assert ("lm_head.weight" in names) is head_in_fp8, (family, sorted(names))
        assert not any("embed" in name for name in names), (family, sorted(names))
