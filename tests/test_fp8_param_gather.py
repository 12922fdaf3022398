"""FP8 parameter gathers (train.fp8_param_gather, parallel/fp8/param_gather.py): at dp 2 under the distributed
optimizer and ZeRO-3, tensorwise and blockwise, in fp32 and in bf16, a run whose linears' weights are all-gathered
as FP8 bytes gives the losses and the weights of the run that gathers them in their dtype, bit for bit (both
quantise the same values with the same scales); the bytes the data-parallel all-gathers move shrink to one per
FP8 weight element; every collective passes the NCCL-rule replay; the validator names what the switch needs."""

from __future__ import annotations

import pytest
import torch
from distributed import cpu_topology, run_ranks
from parity import train_and_gather, whole_shards

from megalite.config_cli import parse_config
from megalite.dryrun.nccl_rules.record import CommRecorder
from megalite.dryrun.nccl_rules.replay import replay

# Two layers of a Llama whose widths tile into 128 x 128 blocks (blockwise), 128 tokens a micro batch; small
# buckets, so that the data-parallel slices cut blocks (checked below); Adam with eps 1 steps about lr * gradient.
BASE = ["--model.family=llama", "--model.num_layers=2", "--model.hidden_size=256", "--model.ffn_hidden_size=384",
        "--model.num_attention_heads=2", "--model.num_query_groups=2", "--model.vocab_size=256",
        "--model.seq_length=128", "--train.micro_batch_size=1", "--train.global_batch_size=4",
        "--optim.lr=1e-3", "--optim.adam_eps=1.0", "--optim.clip_grad=0", "--parallel.bucket_size=200000", "--data.mock=true",
        "--train.device=cpu"]
LAYOUTS = {"distributed optimizer": ["--parallel.distributed_optimizer=true"], "ZeRO-3": ["--parallel.zero_stage=3"]}
PRECISIONS = {"fp32": ["--train.precision=fp32"], "bf16": ["--train.precision=bf16", "--train.param_dtype=bf16"]}
CASES = [(recipe, precision, layout) for recipe in ("tensorwise", "blockwise") for precision in PRECISIONS
         for layout in LAYOUTS]


def _args(case: tuple[str, str, str], gather: bool) -> list[str]:
    recipe, precision, layout = case
    return [*BASE, *PRECISIONS[precision], *LAYOUTS[layout], f"--train.fp8_recipe={recipe}",
            f"--train.fp8_param_gather={str(gather).lower()}"]


def _data_parallel_gathers(record) -> list[tuple[str, int]]:
    """(dtype, bytes received) of each all-gather this rank posted over the data-parallel group."""
    return [(call.dtype, call.payload) for call in record.calls
            if "gather" in call.name and call.desc == "data-parallel"]


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
                                            record=lambda parts, result: _step(parts, result, buckets))
            pair.append((steps, _data_parallel_gathers(recorder.record), buckets, recorder.record))
        results.append(pair)
    return results


def _step(parts, result, buckets: list) -> tuple[float, dict[str, torch.Tensor]]:
    buckets[:] = [(b.end - b.start, b.fp8) for buffer in parts.grads.buffers for b in buffer.layout.buckets]
    return result.loss, whole_shards(parts, parts.topology, lambda m: m.main.clone())


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(2, _run, CASES, observed_groups=True)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(case) for case in CASES])
def test_fp8_gathers_equal_the_run_without_them_bit_for_bit(per_rank, index):
    """Every step's loss and every main weight after it equal the run that gathers the weights in their dtype,
    bit for bit; the collectives pass the NCCL-rule replay."""
    for rank_results in per_rank:
        (plain, *_), (fp8, *_) = rank_results[index]
        for step, ((loss, weights), (fp8_loss, fp8_weights)) in enumerate(zip(plain, fp8)):
            assert fp8_loss == loss, (CASES[index], step)
            assert weights.keys() == fp8_weights.keys()
            for name, weight in weights.items():
                assert torch.equal(fp8_weights[name], weight), (CASES[index], step, name)
    for gather in (0, 1):
        report = replay([rank_results[index][gather][3] for rank_results in per_rank])
        assert report.ok and report.calls > 0, report.text()


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(case) for case in CASES])
def test_fp8_buckets_gather_one_byte_per_element(per_rank, index):
    """With the switch on, every data-parallel all-gather of an FP8 weights' bucket moves one byte per element
    (uint8), half of bf16's bytes and a quarter of fp32's, and the other buckets move their parameters' dtype;
    without it every bucket moves the parameters' dtype."""
    itemsize = 2 if CASES[index][1] == "bf16" else 4
    dtype = "torch.bfloat16" if itemsize == 2 else "torch.float32"
    for rank_results in per_rank:
        (_, plain, plain_buckets, _), (_, fp8, buckets, _) = rank_results[index]
        assert {call[0] for call in plain} == {dtype} and not any(is_fp8 for _, is_fp8 in plain_buckets)
        fp8_sizes = {size for size, is_fp8 in buckets if is_fp8}
        other_sizes = {size * itemsize for size, is_fp8 in buckets if not is_fp8}
        assert fp8_sizes and {call[0] for call in fp8} == {"torch.uint8", dtype}
        assert {nbytes for kind, nbytes in fp8 if kind == "torch.uint8"} == fp8_sizes
        assert {nbytes for kind, nbytes in fp8 if kind == dtype} <= other_sizes
        fp8_bytes = sum(nbytes for kind, nbytes in fp8 if kind == "torch.uint8")
        assert fp8_bytes > 0.5 * sum(nbytes for _, nbytes in fp8), "the FP8 weights are most of what is gathered"
