"""What only a GPU shows: run on a CUDA machine with `pytest -m cuda tests/test_cuda.py` (tools/gpu_check.py runs it
first). Every test is skipped where torch sees no CUDA device, so CPU CI collects and skips them.

CPU CI covers every code path that does not branch on the device; these cover those that do: the RNG tracker on the
CUDA generator (also replayed by activation recompute), SDPA taking a fused kernel (flash or cuDNN) in bf16, torch's
fused AdamW on the device, bf16 parameters stepped through fp32 main weights, the activations autograd saves there
against the planner, the CUDA allocator's memory snapshot and peak, checkpoints of device tensors (also written in
the background while training goes on), a NaN/Inf gradient norm skipping fused AdamW's update on the device,
context parallelism's CUDA flash block kernels (K/V handed to them per query group), and sliding windows with
attention sinks through FlashAttention's window arguments (one device, generation-shaped blocks, context-parallel
blocks), with no score matrix at 32k tokens.

The tests share one process group of one process (NCCL on cuda:0, as pretrain forms it). Context parallelism's
communication needs one GPU per rank under NCCL, so only its kernels are checked here: the all-gather variant's
blocks and log-sum-exp merge, with the cp ranks played one after another.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import tiny_config
from test_attention_windows import grads, reference
from test_context_parallel import assert_kv_per_group_gives_the_same
from test_plan import saved_bytes
from torch.nn.attention import SDPBackend, sdpa_kernel

from megalite.checkpoint.local import Checkpointer, TrainingState, load_checkpoint, rng_state
from megalite.config import Config, OptimConfig
from megalite.config_cli import dump_yaml
from megalite.model.windowed_attention import windowed_attention
from megalite.parallel import context_parallel
from megalite.parallel.context import ParallelContext
from megalite.parallel.distributed_optimizer import adamw, decay_groups
from megalite.parallel.random import TENSOR_PARALLEL, RNGTracker, checkpoint_with_rng
from megalite.parallel.topology import Topology, init_process_group, pick_device, release_process_groups
from megalite.planning.measure import mock_batches
from megalite.planning.memory import chunk_activation_bytes
from megalite.training.build import Trainer, build_model, build_trainer
from megalite.training.pretrain import pretrain
from megalite.training.step import precision_context, train_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    """This process on cuda:0 in a one-process NCCL group, shared by the module's tests."""
    device = pick_device("cuda", 0)
    created = not dist.is_initialized()
    init_process_group(device)
    yield Topology(0, 1, device)
    if created:
        release_process_groups()


def _config(family: str = "gpt2", **train: object) -> Config:
    """The tiny CPU-test model on the GPU with bf16 parameters, one micro batch of 2 per step."""
    return tiny_config(family, train={"device": "cuda", "precision": "bf16", "param_dtype": "bf16",
                                      "micro_batch_size": 2, "global_batch_size": 2, **train},
                       data={"num_workers": 0})


def _held(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Copies of everything a checkpoint holds of the trainer: parameters, fp32 main weights, Adam's state."""
    state, held = trainer.optimizer.optimizer.state, {}
    for m in trainer.optimizer.shards():
        held[f"{m.name}/param"], held[f"{m.name}/main"] = m.param.detach().clone(), m.main.detach().clone()
        held |= {f"{m.name}/{kind}": value.detach().clone() for kind, value in state[m.main].items()}
    return held


def _assert_holds(trainer: Trainer, expected: dict[str, torch.Tensor]) -> None:
    held = _held(trainer)
    assert held.keys() == expected.keys()
    for name, value in expected.items():
        assert (held[name].device, held[name].dtype) == (value.device, value.dtype), name
        assert torch.equal(held[name], value), name


# ---------------------------------------------------------------------------------------------- RNG


def _tracker() -> RNGTracker:
    tracker = RNGTracker(DEVICE)
    tracker.add(TENSOR_PARALLEL, 1234)
    return tracker


def _draw(tracker: RNGTracker) -> torch.Tensor:
    with tracker.fork():
        return torch.rand(1000, device=DEVICE)


def test_rng_tracker_forks_the_cuda_generator_reproducibly():
    """A forked stream draws the same numbers from the same seed, continues where it stopped, restores from
    its saved state, and leaves the default CUDA stream drawing what it would have drawn without it."""
    torch.cuda.manual_seed(7)
    expected_default = [torch.rand(8, device=DEVICE) for _ in range(2)]
    torch.cuda.manual_seed(7)
    tracker = _tracker()
    first = _draw(tracker)
    default_0 = torch.rand(8, device=DEVICE)
    saved = tracker.state_dict()
    second = _draw(tracker)
    default_1 = torch.rand(8, device=DEVICE)
    assert torch.equal(default_0, expected_default[0]) and torch.equal(default_1, expected_default[1])
    assert not torch.equal(first, second)
    again = _tracker()
    assert torch.equal(_draw(again), first) and torch.equal(_draw(again), second)
    tracker.load_state_dict(saved)
    assert torch.equal(_draw(tracker), second)


def test_recompute_replays_the_forked_cuda_stream():
    """Dropout drawn on a forked stream inside a checkpointed block: the recompute in backward draws the same
    mask, so the gradient (2 where kept, 0 where dropped) has the forward output's zeros."""
    tracker = _tracker()

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return F.dropout(x, 0.5, training=True)

    x = torch.ones(4096, device=DEVICE, requires_grad=True)
    out = checkpoint_with_rng(block, x, tracker=tracker)
    out.sum().backward()
    assert torch.equal(x.grad, (out.detach() != 0).float() * 2)


# ------------------------------------------------------------------------------------- kernels, optimizer


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_attention_takes_a_fused_kernel_in_bf16(topology, family):
    """Forward and backward with SDPA restricted to flash and cuDNN attention, which raises when neither
    can run (wrong dtype, layout or head size): the model never falls back to the math kernel.
    Llama uses grouped-query attention (2 KV groups for 4 heads)."""
    cfg = _config(family)
    cfg.model.hidden_size, cfg.model.seq_length = 256, 128  # head dim 64
    model = build_model(cfg, topology.device, ParallelContext.from_topology(topology, False, cfg.train.seed), 0)
    batch = mock_batches(cfg, 1)[0].to(topology.device)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        with precision_context("bf16", topology.device):
            losses = model(batch.tokens, batch.labels)
        losses.mean().backward()
    assert torch.isfinite(losses).all()
    assert all(p.dtype == torch.bfloat16 and p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_fused_adamw_steps_on_cuda():
    """megalite's optimizer is torch's fused AdamW: on the device its steps equal the per-tensor
    implementation's, and its step counts stay on the device."""
    torch.manual_seed(0)
    shapes = {"weight": (64, 32), "bias": (64,)}
    fused_params = {name: torch.randn(shape, device=DEVICE, requires_grad=True) for name, shape in shapes.items()}
    plain_params = {name: p.detach().clone().requires_grad_() for name, p in fused_params.items()}
    cfg = OptimConfig()
    fused = adamw(decay_groups(((n, p, p) for n, p in fused_params.items()), cfg.weight_decay), cfg)
    plain = torch.optim.AdamW(decay_groups(((n, p, p) for n, p in plain_params.items()), cfg.weight_decay),
                              lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=False)
    assert all(group["fused"] for group in fused.param_groups)
    for _ in range(3):
        grads = {name: torch.randn(shape, device=DEVICE) for name, shape in shapes.items()}
        for params, optimizer in ((fused_params, fused), (plain_params, plain)):
            for name, p in params.items():
                p.grad = grads[name].clone()
            optimizer.step()
    for name in shapes:
        torch.testing.assert_close(fused_params[name], plain_params[name], rtol=1e-5, atol=1e-6)
        assert fused.state[fused_params[name]]["step"].device == DEVICE


def test_bf16_parameters_step_through_fp32_main_weights(topology):
    """train.param_dtype=bf16: the model holds bf16 parameters on the GPU, the optimizer fp32 main copies it
    steps with fused AdamW, and every step writes the rounded main weights back into the parameters."""
    cfg = _config("llama")
    with build_trainer(cfg, topology) as trainer:
        assert {(p.dtype, p.device) for p in trainer.model.parameters()} == {(torch.bfloat16, DEVICE)}
        shards = trainer.optimizer.shards()
        assert shards and all(m.main.dtype == torch.float32 and m.main.device == DEVICE and m.is_copy for m in shards)
        assert all(group["fused"] for group in trainer.optimizer.optimizer.param_groups)
        before = [m.main.detach().clone() for m in shards]
        figures = train_step(trainer, mock_batches(cfg, 1)).read()
        assert not figures.skipped and math.isfinite(figures.loss) and math.isfinite(figures.grad_norm)
        assert any(not torch.equal(old, m.main) for old, m in zip(before, shards))
        for m in shards:
            assert torch.equal(m.weights.view_as(m.main), m.main.to(torch.bfloat16)), m.name


def test_a_non_finite_gradient_norm_skips_the_update_on_the_device(topology):
    """A NaN gradient norm reaches fused AdamW as its found_inf tensor on the GPU, and the kernel leaves
    weights, main weights, moments and step counts as they were; the next step updates again."""
    cfg = _config("llama")
    batch = mock_batches(cfg, 1)[0]
    with build_trainer(cfg, topology) as trainer:
        train_step(trainer, [batch])
        expected = _held(trainer)
        poison = trainer.model.final_norm.weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
        figures = train_step(trainer, [batch]).read()
        poison.remove()
        assert figures.diverged and figures.skipped
        _assert_holds(trainer, expected)
        assert not train_step(trainer, [batch]).read().skipped


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("param_dtype", ["bf16", "fp32"])
def test_saved_activations_match_the_planner_on_cuda(family, param_dtype):
    """The planner's CUDA figures against what autograd saves on the GPU under bf16 autocast: CUDA's fused
    RMSNorm keeps its input and rstd (the CPU's composite form an fp32 x and x * rstd), LayerNorm its input in
    the residual stream's dtype (train.fusions: no fp32 copy), flash attention its logsumexp, fused SwiGLU its
    input only. A norm 256 wide, so a wrong norm term misses by over 20%."""
    cfg = _config(family, param_dtype=param_dtype)
    cfg.model.hidden_size, cfg.model.seq_length = 256, 128
    model = build_model(cfg, DEVICE, ParallelContext(), 0).train()
    assert saved_bytes(model, cfg, device=DEVICE) == pytest.approx(chunk_activation_bytes(cfg, 0, "cuda")[0], rel=0.05)


# ---------------------------------------------------------------------------------------- a whole run


def test_memory_snapshot_and_peak_memory_of_a_cuda_run(topology, tmp_path):
    """logging.memory_snapshot dumps the CUDA allocator's history (after step 2), and the metrics record the
    allocator's peak, not the process's RSS."""
    snapshot, metrics = tmp_path / "snapshot.pickle", tmp_path / "metrics.jsonl"
    cfg = _config("gpt2", train_iters=3)
    cfg.logging.memory_snapshot, cfg.logging.metrics_file = str(snapshot), str(metrics)
    assert sorted(pretrain(cfg).losses) == [1, 2, 3]
    dumped = pickle.loads(snapshot.read_bytes())  # written by this test's own run
    assert dumped["segments"] and any(dumped["device_traces"])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["peak_memory_kind"] == "allocated" and r["peak_memory_gib"] > 0 for r in records)


# ---------------------------------------------------------------------------------------- checkpoints


def _save(checkpointer: Checkpointer, trainer: Trainer, step: int) -> Path:
    state = TrainingState(step=step, consumed_samples=step * trainer.cfg.train.global_batch_size)
    rng = rng_state(trainer.topology.device, trainer.ctx.rng)
    return checkpointer.save(state, trainer.sharded_state(), dump_yaml(trainer.cfg), rng)


def _load(cfg: Config, topology: Topology, path: Path) -> tuple[Trainer, TrainingState]:
    """A trainer initialised from another seed, then loaded from `path` as a resume loads it."""
    other = copy.deepcopy(cfg)
    other.train.seed += 1
    trainer = build_trainer(other, topology)
    state, rng, optimizer_loaded, _ = load_checkpoint(path, trainer.sharded_state(), topology)
    assert optimizer_loaded and "cuda" in rng
    trainer.optimizer.gather_params()
    return trainer, state


def test_checkpoint_of_cuda_state_round_trips(topology, tmp_path):
    """Saved from the GPU and loaded back onto it: bf16 parameters, fp32 main weights and Adam's moments
    equal, Adam's step counts back on the device, where fused AdamW goes on stepping them."""
    cfg = _config("llama")
    batch = mock_batches(cfg, 1)[0]
    with build_trainer(cfg, topology) as trainer:
        train_step(trainer, [batch])
        expected = _held(trainer)
        loaded, state = _load(cfg, topology, _save(Checkpointer(str(tmp_path), topology), trainer, 1))
        assert state.step == 1
        _assert_holds(loaded, expected)
        assert not train_step(loaded, [batch]).read().skipped
        steps = {float(s["step"]) for s in loaded.optimizer.optimizer.state.values()}
        assert steps == {2.0}


def test_async_saves_hold_the_state_of_their_step(topology, tmp_path):
    """checkpoint.async_save: each save copies the GPU state to host memory before training goes on, so
    the steps taken while its files are written in the background do not leak into them; the second save
    reuses the first one's host buffers once its files are written."""
    cfg = _config("gpt2")
    batch = mock_batches(cfg, 1)[0]
    with build_trainer(cfg, topology) as trainer:
        checkpointer = Checkpointer(str(tmp_path), topology, async_save=True)
        saved = []
        for step in (1, 2):
            train_step(trainer, [batch])
            saved.append((_held(trainer), _save(checkpointer, trainer, step)))
        train_step(trainer, [batch])
        checkpointer.wait()
        for expected, path in saved:
            assert (path / "index.json").is_file()
            _assert_holds(_load(cfg, topology, path)[0], expected)


# ---------------------------------------------------------------------------------------- context parallel


class _OneOfTheRing:
    """Plays cp rank `rank` of `size` for the all-gather variant, which reads every rank's K/V from its input:
    stands in for context_parallel._Ring (built from a process group) so no communication is needed."""

    def __init__(self, group: tuple[int, int]) -> None:
        self.rank, self.size = group

    def source(self, step: int) -> int:
        return (self.rank - step) % self.size


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


def test_context_parallel_flash_blocks_match_sdpa_in_bf16(monkeypatch):
    """The CUDA flash forward and backward block kernels and the log-sum-exp merge of context parallelism
    (cp 2, grouped-query attention, bf16): every rank's output, dq and summed dK/dV equal fp32 SDPA over
    the whole sequence up to bf16 rounding."""
    monkeypatch.setattr(context_parallel, "_Ring", _OneOfTheRing)
    cp, batch, heads, groups, seq, dim = 2, 2, 8, 2, 400, 64  # chunks of 100 rows: no kernel tile multiple
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, dout = (torch.randn(batch, heads, seq, dim, device=DEVICE, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(batch, groups, seq, dim, device=DEVICE, generator=gen).bfloat16() for _ in range(2))
    reference = [t.float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*reference, is_causal=True, enable_gqa=True)
    out.backward(dout.float())
    expected = {"out": out.detach(), "dq": reference[0].grad, "dk": reference[1].grad, "dv": reference[2].grad}

    positions = [context_parallel.local_positions(seq, cp, rank, DEVICE) for rank in range(cp)]
    gathered = torch.stack([torch.stack([k.index_select(2, p), v.index_select(2, p)]) for p in positions])
    dkv = torch.zeros_like(gathered, dtype=torch.float32)  # what the all-gather's reduce-scatter sums
    for rank, p in enumerate(positions):
        local_q, local_kv = q.index_select(2, p).requires_grad_(), gathered.clone().requires_grad_()
        local_out = context_parallel._GatheredAttention.apply(local_q, local_kv, (rank, cp))
        local_out.backward(dout.index_select(2, p))
        assert local_out.dtype == torch.bfloat16
        for name, got in (("out", local_out.detach()), ("dq", local_q.grad)):
            assert _relative_error(got, expected[name].index_select(2, p)) < 2e-2, (rank, name)
        dkv += local_kv.grad.float()
    for rank, p in enumerate(positions):
        for index, name in enumerate(("dk", "dv")):
            assert _relative_error(dkv[rank, index], expected[name].index_select(2, p)) < 2e-2, (rank, name)


@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_hands_kv_per_group_to_the_flash_kernel(monkeypatch, causal):
    """CUDA's flash kernel takes fewer K/V heads than query heads: context parallelism hands it each block's
    K/V per group, no per-head copy, with the result of K/V expanded to every head (bf16, 64-wide heads)."""
    assert context_parallel.KERNELS_TAKING_GROUPS == {"cuda"}
    assert_kv_per_group_gives_the_same(monkeypatch, DEVICE, torch.bfloat16, causal, seq=256, dim=64)


def _bf16_against_fp32(fn, new: int, total: int, window: int, heads: int = 8, groups: int = 2) -> None:
    """fn(q, k, v, window, sinks) in bf16 (64-wide heads, grouped-query attention) against the fp32 masked softmax
    with the sink column: output and the gradients of q, k, v and the sinks, up to bf16 rounding."""
    gen = torch.Generator(device=DEVICE).manual_seed(new + total)
    q, dout = (torch.randn(2, heads, new, 64, device=DEVICE, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, groups, total, 64, device=DEVICE, generator=gen) for _ in range(2))
    sinks = 2 * torch.randn(heads, device=DEVICE, generator=gen)
    expected = grads(lambda *a: reference(*a[:3], window, a[3]), q, k, v, sinks, dout)
    got = grads(lambda *a: fn(*(t.bfloat16() for t in a[:3]), window, a[3]), q, k, v, sinks, dout.bfloat16())
    for name, g, e in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected):
        assert _relative_error(g, e) < 2e-2, (new, total, window, name, _relative_error(g, e))


@pytest.mark.parametrize("new, total, window", [(1000, 1000, 128), (1000, 1000, 1), (1000, 1000, 5000),
                                                (3, 300, 100), (1, 300, 100)])
def test_windows_and_sinks_run_flash_attentions_window_in_bf16(new, total, window):
    """One device: a window not a multiple of the kernel's tiles, of one position, longer than the sequence; new
    tokens after cached ones (generation)."""
    _bf16_against_fp32(windowed_attention, new, total, window)


def test_context_parallel_windowed_blocks_and_sinks_on_cuda(monkeypatch):
    """The all-gather variant's windowed blocks (cp 2, chunks of 100 positions, a window of 150: blocks banded,
    full and skipped) with sinks, every cp rank played in turn: each rank's rows equal the fp32 reference."""
    monkeypatch.setattr(context_parallel, "_Ring", _OneOfTheRing)
    cp, seq, window = 2, 400, 150
    positions = [context_parallel.local_positions(seq, cp, rank, DEVICE) for rank in range(cp)]

    def attend(q, k, v, w, sinks):
        gathered = torch.stack([torch.stack([k.index_select(2, p), v.index_select(2, p)]) for p in positions])
        out = torch.empty_like(q)
        for rank, p in enumerate(positions):
            local = context_parallel._GatheredAttention.apply(q.index_select(2, p), gathered, (rank, cp), w, sinks)
            out = out.index_copy(2, p, local)
        return out

    _bf16_against_fp32(attend, seq, seq, window)


def test_windowed_attention_at_32k_tokens_keeps_no_score_matrix():
    """Forward and backward over 32768 tokens, 8 heads, a window of 128, with sinks: the peak memory beyond the
    inputs is a few of q's size, where one bf16 score matrix alone would be 16 GiB."""
    q, k, v = (torch.randn(1, heads, 32768, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
               for heads in (8, 2, 2))
    sinks = torch.nn.Parameter(torch.zeros(8, device=DEVICE))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    windowed_attention(q, k, v, 128, sinks).float().square().sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 16 * q.numel() * q.element_size()
    assert q.grad is not None and sinks.grad is not None


def test_grouped_gemm_runs_the_cuda_kernel_in_bf16_and_equals_the_loop():
    """bf16 operands with 16-byte rows take torch._grouped_mm's CUDA kernel (uneven groups, one empty);
    fp32 ones fall back to the loop over experts. Both equal per-expert matmuls."""
    from megalite.parallel.gemm import grouped_kernel_takes, grouped_linear

    counts = torch.tensor([300, 0, 517, 9], device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(int(counts.sum()), 256, device=DEVICE, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(4, 128, 256, device=DEVICE, generator=gen).requires_grad_()
        assert grouped_kernel_takes(x, w.to(dtype)) == (dtype == torch.bfloat16)
        y = grouped_linear(x, w, counts.cumsum(0).to(torch.int32))
        y.float().square().sum().backward()
        parts = x.detach().float().split(counts.tolist())
        loop = torch.cat([part @ w.detach()[e].to(dtype).float().t() for e, part in enumerate(parts)])
        assert _relative_error(y.float(), loop) < 2e-2, dtype
        assert x.grad is not None and w.grad is not None


def test_the_stop_vote_is_queued_without_waiting_for_the_device(topology):
    """Each step's stop vote (Topology.max_over_ranks_later): the copy to the device, the all-reduce and the copy
    back are queued behind a step's work without a synchronisation (sync debug mode raises on one), and the
    read gives the maximum once the device got there. A topology of 2 ranks takes the collective path; the
    all-reduce runs in the module's one-rank NCCL group."""
    in_a_job = copy.copy(topology)
    in_a_job.world_size = 2
    in_a_job.max_over_ranks_later([0.0, 0.0])()  # the communicator's set-up may synchronise
    work = torch.randn(2048, 2048, device=DEVICE)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            work = work @ work / work.norm()
        read = in_a_job.max_over_ranks_later([15.0, 1.0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert read() == [15.0, 1.0]
