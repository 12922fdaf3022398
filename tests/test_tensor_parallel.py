"""Tensor (and sequence) parallelism equals one device: logits, per-token losses and every
parameter's gradient, for every family (qwen3's per-head q/k norm weights, shared by the ranks' heads,
included), vocabularies not divisible by tp, SP on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from distributed import cpu_topology, run_ranks, tiny_run

from megalite.model.gpt import GPTModel
from megalite.parallel.placement import unshard
from megalite.training.build import build_trainer

ROOT = Path(__file__).resolve().parents[1]
CASES = [(family, sp) for family in ("gpt2", "llama", "qwen3") for sp in (False, True)]


def _config(family: str, **sections):
    # vocab 250 pads to 256: with tp=4 the last rank's vocabulary slice is partly padding
    model = {"vocab_size": 250, "num_query_groups": None if family == "gpt2" else 4, "num_attention_heads": 8}
    return tiny_config(family, model=model, **sections)


def _reference(family: str, tokens: torch.Tensor):
    cfg = _config(family)
    model = GPTModel(cfg.model, torch.device("cpu"), seed=cfg.train.seed)
    losses = model(tokens, tokens.roll(-1, 1))
    losses.sum().backward()
    with torch.no_grad():
        logits = model(tokens)
    return logits, losses.detach(), {n: p.grad for n, p in model.named_parameters()}


def _gather_full(grad: torch.Tensor, spec, group) -> torch.Tensor:
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return unshard(parts, spec)


def _tp_run(rank: int, world_size: int) -> list[str]:
    """Compare every case on this rank; return a list of mismatch descriptions (empty = parity)."""
    topology = cpu_topology(rank, world_size, tp=world_size)
    failures = []
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    for family, sp in CASES:
        ref_logits, ref_losses, ref_grads = _reference(family, tokens)
        with build_trainer(_config(family, parallel={"tp": world_size, "sequence_parallel": sp}), topology) as trainer:
            model = trainer.model
            losses = model(tokens, tokens.roll(-1, 1))
            losses.sum().backward()
            trainer.grads.reduce()
        with torch.no_grad():
            logits = model(tokens)
        checks = {"logits": (logits, ref_logits), "losses": (losses.detach(), ref_losses)}
        shards = {n: dict(p.shards)["tp"] for n, p in model.placements_by_name().items() if p.shards}
        for name, param in model.named_parameters():
            grad = _gather_full(param.main_grad, shards[name], topology.tp_group) if name in shards else param.main_grad
            checks[f"grad {name}"] = (grad, ref_grads[name])
        for what, (got, want) in checks.items():
            if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=0):
                same = got.shape == want.shape
                diff = (got - want).abs().max().item() if same else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
                failures.append(f"{family} sp={sp} {what}: {diff}")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_one_device(world_size):
    failures = run_ranks(world_size, _tp_run)
    assert failures == [[]] * world_size


RUN = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=8", "--model.seq_length=32",
       "--model.vocab_size=250", "--train.micro_batch_size=2", "--train.global_batch_size=4", "--train.train_iters=5",
       "--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0"]


def _losses(tmp_path: Path, nproc: int, family: str, extra: list[str]) -> list[float]:
    records = tiny_run(tmp_path, nproc, f"--model.family={family}", *extra, base=RUN, name=f"{family}{len(extra)}")
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict[str, list[float]]:
    """Each family's one-process losses, the reference of every case below."""
    tmp = tmp_path_factory.mktemp("tp-reference")
    return {family: _losses(tmp, 1, family, []) for family in ("gpt2", "llama")}


@pytest.mark.parametrize("family, nproc, extra", [
    ("gpt2", 2, ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    ("llama", 2, ["--parallel.tp=2"]),
    ("llama", 4, ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
])
def test_five_steps_equal_one_device(tmp_path, one_device, family, nproc, extra):
    """Five optimizer steps; the 4-process case is tp=2 x dp=2."""
    reference = one_device[family]
    assert _losses(tmp_path, nproc, family, extra) == pytest.approx(reference, rel=1e-5)


def test_checkpoint_saved_at_tp2_resumes_at_tp1(tmp_path, one_device):
    ckpt = [f"--checkpoint.save={tmp_path / 'ckpt'}", f"--checkpoint.load={tmp_path / 'ckpt'}"]
    reference = one_device["llama"]
    layout = ["--parallel.tp=2", "--parallel.sequence_parallel=true"]
    first = _losses(tmp_path, 2, "llama", [*layout, "--train.exit_interval=2", *ckpt])
    resumed = _losses(tmp_path, 1, "llama", ["--data.num_workers=0", *ckpt])
    assert first + resumed == pytest.approx(reference, rel=1e-5)
