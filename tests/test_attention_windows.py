"""Sliding windows and attention sinks (parallel/attention_masks.py, model/windowed_attention.py, context_parallel.py).

- The kernel path (CPU's fused kernel with each block's mask; the full-score path CUDA takes in fp32; CUDA's flash
  kernel in tests/test_cuda.py) equals a plain masked softmax with the sink as one more column: output and the
  gradients of q, k, v and the sinks, with grouped-query attention, windows of 1 position up to longer than the
  sequence, and new tokens after cached ones.
- `visible` trims every block to rows that see a key and keys some row sees, and its band is the window's rule.
- Generation through the windowed KV cache gives the tokens of generation without a cache; the cache of a windowed
  layer holds at most window - 1 tokens.
- In one spawned group of four gloo ranks: context-parallel attention at cp 4 (ring and all-gather; blocks wholly
  outside the window skipped) equals one device's, values and gradients, and obeys NCCL's rules; and a tiny gpt-oss
  (sinks, windows of 6 on the even layers, shorter than the 32-token sequence and than a cp chunk at cp 2, experts
  with biases, a router bias) trained at tp 2 x pp 2, cp 2 (ring, and all-gather under pp 2), ZB-V with cp 2 and
  selective recompute, cp 2 x dp 2 under ZeRO-3 with full recompute, and ep 2 x etp 2 (the experts' biases split
  and partial) equals the one-device run: losses and every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from distributed import cpu_topology, run_ranks
from parity import assert_equals_one_device, on_one_device, train_and_gather

from megalite.config import Config
from megalite.dryrun.nccl_rules.record import CommRecorder
from megalite.dryrun.nccl_rules.replay import replay
from megalite.inference.generate import Sampling, generate
from megalite.model.gpt import GPTModel
from megalite.model.kv_cache import KVCache
from megalite.model.windowed_attention import windowed_attention
from megalite.parallel.attention_masks import additive_mask, visible
from megalite.parallel.context_parallel import context_parallel_attention, local_positions
from megalite.parallel.topology import Topology
from megalite.training.build import is_logging_rank


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over [scores masked by q - k in [0, window) | the head's sink] without the sink's column, times v;
    the queries are the last of the keys' positions."""
    heads, new, total = q.shape[1], q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    distance = torch.arange(total - new, total, device=q.device).unsqueeze(1) - torch.arange(total, device=q.device)
    seen = (distance >= 0) & (distance < (window or total + 1))
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), dim=-1)
    return scores.softmax(-1)[..., :total] @ v


def grads(fn, q, k, v, sinks, dout) -> list[torch.Tensor]:
    """fn(q, k, v, sinks)'s output and the gradients of q, k, v (and of the sinks, when given) for `dout`."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink = None if sinks is None else torch.nn.Parameter(sinks.clone())
    out = fn(*leaves, sink)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)] + ([] if sink is None else [sink.grad])


@pytest.mark.parametrize("new, total, window, groups, sinks", [
    (24, 24, 5, 2, True), (24, 24, 1, 4, True), (24, 24, 30, 2, True), (24, 24, None, 2, True),
    (24, 24, 7, 4, False), (3, 20, 6, 2, True), (1, 20, 4, 1, True),
])
def test_windowed_kernel_equals_masked_softmax_with_a_sink_column(new, total, window, groups, sinks):
    gen = torch.Generator().manual_seed(new + total)
    q, dout = torch.randn(2, 4, new, 16, generator=gen), torch.randn(2, 4, new, 16, generator=gen)
    k, v = torch.randn(2, groups, total, 16, generator=gen), torch.randn(2, groups, total, 16, generator=gen)
    sink = 2 * torch.randn(4, generator=gen) if sinks else None
    got = grads(lambda *a: windowed_attention(*a[:3], window, a[3]), q, k, v, sink, dout)
    expected = grads(lambda *a: reference(*a[:3], window, a[3]), q, k, v, sink, dout)
    for name, g, e in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


def test_the_full_score_path_cuda_runs_in_fp32_equals_it_too(monkeypatch):
    """CUDA's flash kernel takes no fp32; there the blocks' scores are computed in full (`_math_forward`), with
    K/V handed over per group as on CUDA."""
    from megalite.model import windowed_attention as module
    from megalite.parallel import context_parallel

    monkeypatch.setattr(module, "_kernels", lambda q: (module._math_forward, module._math_backward))
    monkeypatch.setattr(context_parallel, "KERNELS_TAKING_GROUPS", {"cpu", "cuda"})
    gen = torch.Generator().manual_seed(0)
    q, dout = torch.randn(2, 4, 5, 16, generator=gen), torch.randn(2, 4, 5, 16, generator=gen)
    k, v = torch.randn(2, 2, 20, 16, generator=gen), torch.randn(2, 2, 20, 16, generator=gen)
    sinks = torch.randn(4, generator=gen)
    got = grads(lambda *a: windowed_attention(*a[:3], 6, a[3]), q, k, v, sinks, dout)
    expected = grads(lambda *a: reference(*a[:3], 6, a[3]), q, k, v, sinks, dout)
    for name, g, e in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


def test_visible_trims_each_block_to_the_windows_pairs():
    """For every block (queries at qs.., keys at ks..) and window: the trimmed rows and columns with the band's mask
    are exactly the pairs with 0 <= q - k < window, every trimmed row and column keeps one, nothing else is seen."""
    for qs, ql, ks, kl, window in [(qs, ql, ks, kl, w) for qs in (0, 3, 9) for ql in (1, 4) for ks in (0, 2, 8)
                                   for kl in (1, 5) for w in (None, 1, 2, 4, 9)]:
        rule = torch.arange(qs, qs + ql).unsqueeze(1) - torch.arange(ks, ks + kl)
        rule = (rule >= 0) & (rule < (window or 100))
        seen = visible(qs, ql, ks, kl, window)
        if seen is None:
            assert not rule.any()
            continue
        rows, cols, band = seen
        inside = torch.zeros_like(rule)
        mask = additive_mask(band, rows.stop - rows.start, cols.stop - cols.start, torch.float32, torch.device("cpu"))
        inside[rows, cols] = True if mask is None else mask == 0
        assert torch.equal(inside, rule), (qs, ql, ks, kl, window)
        assert inside[rows].any(1).all() and inside[:, cols].any(0).all()


def _gpt_oss(layers: int = 4, **parallel) -> Config:
    """A tiny gpt-oss: sinks, windows of 6 on the even layers, YaRN, four experts with biases, a router bias."""
    model = {"num_layers": layers, "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 250,
             "sliding_window": 6, "sliding_window_layers": list(range(0, layers, 2)), "num_experts": 4,
             "moe_topk": 2, "moe_ffn_hidden_size": 32, "rope_scaling": "yarn", "rope_original_max_positions": 8,
             "rope_truncate": False}
    train = {"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 3,
             "recompute": parallel.pop("recompute", "none")}
    return tiny_config("gpt_oss", model=model, train=train, parallel=parallel)


def test_generation_through_the_windowed_cache_equals_generation_without_it():
    model = GPTModel(_gpt_oss().model, torch.device("cpu"), seed=3).eval()
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.sinks.normal_(0, 1)
    prompt = torch.randint(0, 250, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    cached = generate(model, prompt, Sampling(max_new_tokens=12, temperature=0))
    assert cached == generate(model, prompt, Sampling(max_new_tokens=12, temperature=0, use_cache=False))
    cache = KVCache(32)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    assert cache.length == 9
    # windowed layers keep the last 5 of the 9 tokens; full ones their preallocated 32
    assert {i: layer.keys.shape[2] for i, layer in cache.layers.items()} == {0: 5, 1: 32, 2: 5, 3: 32}


# ------------------------------------------------------------------------------ one group of four ranks

CP_CASES = [(comm, window, groups) for comm in ("p2p", "allgather") for window, groups in ((5, 2), (12, 4), (3, 2))]
SEQ, HEADS = 64, 4  # at cp 4: chunks of 8 positions, so windows of 3, 5 and 12 skip whole blocks
LAYOUTS = [  # (name, parallel fields)
    ("tp 2 x pp 2, SP", {"tp": 2, "pp": 2, "sequence_parallel": True}),
    ("cp 2 ring x dp 2", {"cp": 2}),
    ("cp 2 all-gather x pp 2", {"cp": 2, "cp_comm": "allgather", "pp": 2}),
    ("ZB-V pp 2 x cp 2, selective recompute", {"pp": 2, "vp": 2, "pipeline_schedule": "zb-v", "cp": 2,
                                                "recompute": "selective"}),
    ("cp 2 ring x dp 2, ZeRO-3, full recompute", {"cp": 2, "zero_stage": 3, "bucket_size": 20_000,
                                                  "recompute": "full"}),
    # the experts' second bias added by etp rank 0 alone, its gradient partial over etp
    ("tp 2 x dp 2, SP, ep 2 x etp 2", {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 2}),
]


def _cp_inputs(groups: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(groups)
    shapes = [(2, HEADS, SEQ, 16), (2, groups, SEQ, 16), (2, groups, SEQ, 16), (2, HEADS, SEQ, 16), (HEADS,)]
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _cp_attention(rank: int, world_size: int) -> list:
    """Each CP case's output and gradients on this rank (its positions), and its communication record."""
    results = []
    for comm, window, groups in CP_CASES:
        positions = local_positions(SEQ, world_size, rank)
        q, k, v, dout, sinks = _cp_inputs(groups)
        q, k, v, dout = (t.index_select(2, positions) for t in (q, k, v, dout))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        sinks = torch.nn.Parameter(sinks)
        with CommRecorder(rank) as recorder:
            out = context_parallel_attention(q, k, v, dist.group.WORLD, comm, window, sinks)
            out.backward(dout)
        results.append(([t.detach() for t in (out, q.grad, k.grad, v.grad)] + [sinks.grad], recorder.record))
    return results


def _four_ranks(rank: int, world_size: int) -> tuple[list, list]:
    attention = _cp_attention(rank, world_size)
    layouts = []
    for _, parallel in LAYOUTS:
        cfg = _gpt_oss(**dict(parallel))
        losses, gradients = train_and_gather(cfg, cpu_topology(rank, world_size, cfg))
        logging = is_logging_rank(cfg, Topology.from_config(rank, world_size, torch.device("cpu"), cfg.parallel, True))
        layouts.append((losses if logging else None, gradients))
    return attention, layouts


@pytest.fixture(scope="module")
def four_ranks() -> list:
    return run_ranks(4, _four_ranks, observed_groups=True)


def test_context_parallel_windows_and_sinks_equal_one_device_at_cp4(four_ranks):
    for index, (comm, window, groups) in enumerate(CP_CASES):
        q, k, v, dout, sinks = _cp_inputs(groups)
        expected = grads(lambda *a, w=window: reference(*a[:3], w, a[3]), q, k, v, sinks, dout)
        dsinks = sum(per_rank[0][index][0][4] for per_rank in four_ranks)  # each rank's rows' part
        torch.testing.assert_close(dsinks, expected[4], rtol=1e-5, atol=1e-6, msg=f"{comm} {window} dsinks")
        for rank, per_rank in enumerate(four_ranks):
            positions = local_positions(SEQ, 4, rank)
            for name, got, full in zip(("out", "dq", "dk", "dv"), per_rank[0][index][0], expected):
                torch.testing.assert_close(got, full.index_select(2, positions), rtol=1e-5, atol=1e-6,
                                           msg=f"{comm} window {window} rank {rank} {name}")
        report = replay([per_rank[0][index][1] for per_rank in four_ranks])
        assert report.ok, f"{comm} window {window}:\n{report.text()}"


@pytest.fixture(scope="module")
def one_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    return on_one_device(_gpt_oss())


def test_windows_and_sinks_train_at_every_layout_as_on_one_device(four_ranks, one_device):
    """Losses and every gradient the optimizers stepped with (the sinks', the experts' and router's biases
    included), fp32, over three steps."""
    per_rank = [layouts for _, layouts in four_ranks]
    for index, (name, _) in enumerate(LAYOUTS):
        losses = next(r[index][0] for r in per_rank if r[index][0] is not None)
        assert_equals_one_device(name, losses, per_rank, index, one_device)
