"""Data parallelism with bucketed, overlapped gradient reduction and the distributed optimizer:
the same losses as one device with the same global batch, in 1D and in 3D layouts, with
clipping active; optimizer shards disjoint and covering; checkpoints across layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks, tiny_run
from parity import LLAMA, TINY
from parity import clipped_run as _run

from megalite.training.build import build_trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--parallel.overlap_grad_reduce=false"]),
    (2, ["--parallel.distributed_optimizer=true"]),
    (4, []),
    (4, ["--parallel.distributed_optimizer=true"]),
    (2, ["--parallel.distributed_optimizer=true", "--parallel.overlap_param_gather=true"]),
])
def test_data_parallel_matches_one_device(tmp_path, reference, nproc, extra):
    assert _run(tmp_path, nproc, *extra) == pytest.approx(reference["gpt2"], rel=1e-5)


def test_tied_embeddings_across_stages_with_distributed_optimizer(tmp_path):
    """The word embeddings live on the first and last stage with different buffer layouts; their
    gradients must be combined before the reduce-scatter (a higher LR makes any error visible)."""
    fast = ["--optim.lr=1e-2", "--optim.min_lr=1e-3"]
    one = tiny_run(tmp_path, 1, *fast, base=TINY)
    split = tiny_run(tmp_path, 4, *fast, "--parallel.pp=2", "--parallel.distributed_optimizer=true", base=TINY)
    assert [r["grad_norm"] for r in split] == pytest.approx([r["grad_norm"] for r in one], rel=1e-6)
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in one], rel=1e-6)


def test_3d_with_interleaving_sp_and_distributed_optimizer(tmp_path, reference):
    layout = ["--parallel.tp=2", "--parallel.pp=2", "--parallel.vp=2", "--parallel.sequence_parallel=true",
              "--parallel.distributed_optimizer=true"]
    assert _run(tmp_path, 8, *LLAMA, *layout) == pytest.approx(reference["llama"], rel=1e-5)


def test_distributed_optimizer_checkpoint_resumes_elsewhere(tmp_path, reference):
    ckpt = [f"--checkpoint.save={tmp_path / 'ckpt'}", f"--checkpoint.load={tmp_path / 'ckpt'}"]
    first = _run(tmp_path, 4, "--parallel.distributed_optimizer=true", "--train.exit_interval=2", *ckpt, name="first")
    second = _run(tmp_path, 2, "--parallel.tp=2", *ckpt, name="second")
    assert first + second == pytest.approx(reference["gpt2"], rel=1e-5)


def _shards(rank: int, world_size: int) -> list[tuple[str, int, int]]:
    cfg = tiny_config(parallel={"distributed_optimizer": True, "bucket_size": 3000})
    parts = build_trainer(cfg, cpu_topology(rank, world_size))
    return [(m.name, m.start, m.end) for m in parts.optimizer.shards()]


def test_optimizer_shards_are_disjoint_and_cover_every_parameter():
    cfg = tiny_config()
    from megalite.model.gpt import GPTModel

    sizes = {n: p.numel() for n, p in GPTModel(cfg.model, torch.device("cpu"), seed=cfg.train.seed).named_parameters()}
    covered = {n: [] for n in sizes}
    for rank_shards in run_ranks(4, _shards):
        for name, lo, hi in rank_shards:
            covered[name].append((lo, hi))
    for name, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[name], name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"{name}: gaps or overlaps {ranges}"


def test_bf16_data_parallel_matches_one_device_bf16(tmp_path):
    """bf16 autocast keeps fp32 parameters and gradients: each micro batch's forward is the same
    computation at any dp (same shapes, same data), only the fp32 gradient sum's order differs, so
    the losses agree to fp32 rounding carried through a few steps of bf16 matmuls (1e-4 relative)."""
    one = _run(tmp_path, 1, "--train.precision=bf16", name="bf16-one")
    two = _run(tmp_path, 2, "--train.precision=bf16", "--parallel.distributed_optimizer=true", name="bf16-two")
    assert two == pytest.approx(one, rel=1e-4)


BF16_PARAMS = ["--train.precision=bf16", "--train.param_dtype=bf16"]


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory) -> list[float]:
    return _run(tmp_path_factory.mktemp("bf16"), 1, *BF16_PARAMS, name="bf16-params")


def test_bf16_parameters_with_fp32_main_weights(tmp_path, bf16_reference):
    """bf16 parameters, fp32 grads and main weights: every micro batch's forward sees the same bf16
    weights at any dp, but the fp32 gradient sums differ in order, and a main weight that moves by
    an fp32 rounding step can round to a neighbouring bf16 value (relative step 2^-8). Over five
    steps that shifts losses by about 1e-5 here; 1e-4 keeps 10x margin and still fails on any real
    error (a lost update or an unscaled gradient moves the loss by > 1e-3)."""
    two = _run(tmp_path, 2, *BF16_PARAMS, "--parallel.distributed_optimizer=true",
               "--parallel.overlap_param_gather=true", name="dp2")
    assert two == pytest.approx(bf16_reference, rel=1e-4)
    three_d = _run(tmp_path, 4, *BF16_PARAMS, "--parallel.tp=2", "--parallel.pp=2", "--parallel.sequence_parallel=true",
                   "--parallel.distributed_optimizer=true", name="3d")
    assert three_d == pytest.approx(bf16_reference, rel=1e-4)


def test_bf16_parameters_resume_from_fp32_main_weights(tmp_path, bf16_reference):
    """The checkpoint holds the fp32 main weights: resuming at another layout (dist-opt shards to
    whole tensors) continues the run instead of restarting from bf16-rounded weights."""
    ckpt = [f"--checkpoint.save={tmp_path / 'ckpt'}", f"--checkpoint.load={tmp_path / 'ckpt'}"]
    first = _run(tmp_path, 2, *BF16_PARAMS, "--parallel.distributed_optimizer=true", "--train.exit_interval=2", *ckpt,
                 name="first")
    second = _run(tmp_path, 1, *BF16_PARAMS, *ckpt, name="second")
    assert first + second == pytest.approx(bf16_reference, rel=1e-4)


def test_bf16_gradient_reduction(tmp_path, reference):
    """parallel.grad_reduce_dtype=bf16 accumulates and reduces gradients in bf16 (8 mantissa bits):
    the update differs from fp32 by ~0.4% of each gradient, so losses agree only loosely (1e-3)."""
    assert _run(tmp_path, 2, "--parallel.grad_reduce_dtype=bf16", "--parallel.distributed_optimizer=true",
                name="gr16") == pytest.approx(reference["gpt2"], rel=1e-3)


class _LateGather:
    """A parameter all-gather that only lands when waited on: until then the bucket holds NaN."""

    def __init__(self, gather, output: torch.Tensor, shard: torch.Tensor, group) -> None:
        self.gather, self.output, self.shard, self.group = gather, output, shard.clone(), group
        output.fill_(float("nan"))

    def wait(self) -> bool:
        self.gather(self.output, self.shard, group=self.group)
        return True

    def is_completed(self) -> bool:
        return False


def _late_gathers(rank: int, world_size: int, runs: list[list[str]]) -> list[tuple[dict, float | None]]:
    """Each run with every asynchronous all-gather (the overlapped parameter gathers) delayed until waited on."""
    import os

    import torch.distributed as dist

    from megalite.config_cli import parse_config
    from megalite.training.pretrain import pretrain

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = []
    for args in runs:
        for name in ("all_gather_single", "all_gather_into_tensor"):
            original = getattr(dist, name)

            def late(output, tensor, group=None, async_op=False, original=original):
                return (_LateGather(original, output, tensor, group) if async_op
                        else original(output, tensor, group=group))

            setattr(dist, name, late)
        try:
            result = pretrain(parse_config(args))
        finally:
            for name in ("all_gather_single", "all_gather_into_tensor"):
                setattr(dist, name, getattr(dist.distributed_c10d, name))
        results.append((result.losses, result.val_loss))
    return results


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_no_parameter_is_read_before_its_gather_lands(family):
    """Overlapped parameter gathers, made to land only when waited on: every weight read (including
    the LM head and gpt2's position table) must wait for its bucket,
    in training and in evaluation, or NaN reaches the loss. Small buckets: one parameter each. ZeRO-3's
    gathers too: before each forward, each backward and each recompute (full recompute)."""
    base = ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4",
            "--model.seq_length=16", "--model.vocab_size=250", "--train.micro_batch_size=1",
            "--train.global_batch_size=4", "--train.train_iters=3", "--train.eval_interval=1", "--train.eval_iters=1",
            "--parallel.bucket_size=100", "--logging.progress_bar=false", "--logging.log_interval=1",
            "--data.mock=true", "--data.num_workers=0", "--train.device=cpu",
            f"--model.family={family}"] + (["--model.num_query_groups=2"] if family == "llama" else [])
    overlapped = [*base, "--parallel.distributed_optimizer=true", "--parallel.overlap_param_gather=true"]
    stage3 = [*base, "--parallel.zero_stage=3", "--train.recompute=full"]
    (late, late_val), (late3, late3_val), (plain, plain_val) = run_ranks(2, _late_gathers,
                                                                         [overlapped, stage3, base])[-1]
    assert late == pytest.approx(plain, rel=1e-5) and late_val == pytest.approx(plain_val, rel=1e-5)
    assert late3 == pytest.approx(plain, rel=1e-5) and late3_val == pytest.approx(plain_val, rel=1e-5)
