"""Zero-bubble schedules (parallel/pipeline/zero_bubble.py) and the split backward they run (parallel/weight_grads.py).

- Each rank's list runs every F, B and W once, each after what it needs on the rank, and holds no more micro
  batches between forward and weight gradient than 1F1B's first rank (interleaved 1F1B's with vp > 1; ZB-V
  2 pp chunks: 1F1B's pp stages).
- Played out with free messages (planning/bubble.py), the lists idle as their formulas say: ZB-H1 exactly
  (pp-1)(T_F + T_B - T_W) for any times, ZB-V its formula at equal times and no more whenever neither F nor W
  takes longer than B; ZB-V and interleaved ZB-H1 under 0.6 of 1F1B's and interleaved 1F1B's bubble.
- The lock-step communication plan exists for every micro batch count at pp 2, 4 and 8, its exchanges (one
  neighbour each) cost nothing over free messages; the real executor runs them on the fake process group at pp
  16, and NCCL's rules hold with the neighbour pairs' communicators side by side or one after another (pp 2, 4
  and 8 on real gloo ranks in tests/test_nccl_rules.py).
- B followed by W gives every layer type's gradients bit for bit as the same model's fused backward (fp32):
  embeddings, learned positions, LayerNorm and RMSNorm (and Qwen3's q/k norms), biases, the tied LM head with
  its fused cross-entropy, mixture-of-experts router, grouped experts, shared expert and its gate, gpt-oss's sinks
  (through windowed attention), expert and router biases; with full and
  selective recompute. Against the plain modules (what a non-splitting schedule runs) LayerNorm models are bit
  for bit equal too; RMSNorm's input gradient adds its parts in another order (fp32 rounding). A compiled
  layer defers them too.
- Trained, ZB-H1, ZB-V and DualPipeV equal the one-device run (losses and every gradient, fp32) at pp 2 and 4
  with tp 2 + SP, dp 2 + the distributed optimizer, ZeRO-3, experts (DualPipeV's pairs interleaved at the
  expert all-to-all over ep 2), full and selective recompute (torch.compile: in tests/test_compile.py);
  checkpoints move between ZB-V, DualPipeV and interleaved 1F1B; the trace shows the W operations and the pairs.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks, tiny_run
from parity import assert_equals_one_device, on_one_device, train_and_gather

from megalite.config import Config
from megalite.dryrun.pipeline_plan import check_pipeline
from megalite.model.gpt import GPTModel
from megalite.model.recompute import apply_recompute
from megalite.model.split_backward import apply_split_backward
from megalite.parallel.context import ParallelContext
from megalite.parallel.pipeline.ops import B, F, W
from megalite.parallel.pipeline.plan import communication_plan
from megalite.parallel.pipeline.registry import bubble_fraction, schedule_ops
from megalite.parallel.topology import Topology
from megalite.parallel.weight_grads import WeightGradients, deferred
from megalite.planning.bubble import simulated_bubble
from megalite.training.build import is_logging_rank

CASES = ([("zb-h1", pp, 1, m) for pp in (2, 4, 8) for m in (1, 2, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1)]
         + [("zb-h1", pp, vp, m) for pp in (2, 4, 8) for vp in (2, 3) for m in (pp, 2 * pp, 3 * pp)]
         + [("zb-v", pp, 2, m) for pp in (2, 4, 8) for m in (1, 2, pp, 2 * pp - 1, 2 * pp, 3 * pp + 1)])


def _in_flight_bound(name: str, pp: int, vp: int, m: int) -> int:
    """1F1B's first rank's peak, in chunk forwards: pp (one chunk), interleaved 1F1B's warm-up + 1 (all m * vp
    when m == pp), ZB-V's 2 pp chunks."""
    if name == "zb-v":
        return 2 * pp
    if vp == 1:
        return min(pp, m)
    return m * vp if m == pp else min(2 * (pp - 1) + (vp - 1) * pp + 1, m * vp)


@pytest.mark.parametrize("name, pp, vp, m", [c for c in CASES if c[1] > 1 or c[0] != "zb-v"])
def test_every_operation_once_in_order_within_1f1b_memory(name, pp, vp, m):
    for rank in range(pp):
        ops = schedule_ops(name, pp, vp, rank, m)
        assert sorted(ops) == sorted((kind, c, i) for kind in (F, B, W) for c in range(vp) for i in range(m))
        seen, in_flight, peak = set(), 0, 0
        for kind, chunk, mb in ops:
            before = {F: None, B: F, W: B}[kind]
            assert before is None or (before, chunk, mb) in seen, f"rank {rank}: {kind}{chunk}.{mb} before {before}"
            seen.add((kind, chunk, mb))
            in_flight += (kind == F) - (kind == W)
            peak = max(peak, in_flight)
        assert peak <= _in_flight_bound(name, pp, vp, m), (rank, peak)


TIMES = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.2, 0.8), (2.0, 1.0, 1.0)]


@pytest.mark.parametrize("times", TIMES)
def test_lists_idle_as_their_formulas_say(times):
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 3 * pp + 1):
            assert simulated_bubble("zb-h1", pp, 1, m, *times) == pytest.approx(
                bubble_fraction("zb-h1", pp, 1, m, *times)), (pp, m)
            assert simulated_bubble("1f1b", pp, 1, m, *times) == pytest.approx(
                bubble_fraction("1f1b", pp, 1, m, *times)), (pp, m)
        for m in (2 * pp - 1, 2 * pp, 3 * pp + 1):
            zb_v, formula = simulated_bubble("zb-v", pp, 2, m, *times), bubble_fraction("zb-v", pp, 2, m, *times)
            if times == (1.0, 1.0, 1.0):
                assert zb_v == pytest.approx(formula), (pp, m)
            if max(times[0], times[2]) <= times[1]:
                assert zb_v <= formula + 1e-9, (pp, m, times)
            assert zb_v < 0.6 * simulated_bubble("1f1b", pp, 1, m, *times), (pp, m, times)  # same memory
        for m in (2 * pp, 4 * pp):
            interleaved = simulated_bubble("1f1b", pp, 2, m, *times)
            assert simulated_bubble("zb-h1", pp, 2, m, *times) < 0.6 * interleaved, (pp, m, times)


@pytest.mark.parametrize("times", [(20.0, 31.3, 9.6), *TIMES])
def test_exchanges_with_one_neighbour_each_cost_nothing(times):
    """Played with the communication plan's exchanges, every schedule idles as with free messages: each exchange
    holds one neighbour's messages, so a rank waiting for its input waits for nobody else. (When an exchange
    held a whole round, with both neighbours, ZB-H1 idled 0.342 and 0.256 at the benchmark's times, pp 4, m = 8
    and 16, against 0.257 and 0.128: docs/benchmarks.md.)"""
    for name, vp in (("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-h1", 2), ("zb-v", 2), ("dualpipev", 2)):
        for pp, m in ((2, 8), (4, 8), (4, 16), (8, 16)):
            assert simulated_bubble(name, pp, vp, m, *times, exchanges=True) == pytest.approx(
                simulated_bubble(name, pp, vp, m, *times)), (name, vp, pp, m)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_lock_step_plan_exists_for_every_micro_batch_count(pp):
    """The plan is NCCL-safe by construction once it exists (parallel/pipeline/plan.py); it exists for every count
    allowed: any for ZB-H1 and ZB-V, multiples of pp for interleaved ZB-H1."""
    for m in range(1, 4 * pp + 2):
        for name, vp in [("zb-h1", 1), ("zb-v", 2)] + ([("zb-h1", 2), ("zb-h1", 3)] if m % pp == 0 else []):
            plans = communication_plan(name, pp, vp, m)
            assert sum(len(rounds) for plan in plans.values() for rounds in plan) > 0, (name, vp, m)


@pytest.mark.parametrize("name, vp, m", [("zb-h1", 1, 16), ("zb-h1", 2, 32), ("zb-v", 2, 31)])
def test_executor_replays_under_nccl_rules_at_pp16(name, vp, m):
    report = check_pipeline(name, 16, vp, m)
    assert report.ok, report.text()
    assert report.messages > 0


def _model_config(family: str, **fields) -> Config:
    cfg = Config()
    m = cfg.model
    m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = family, 2, 32, 4, 16, 100
    for name, value in fields.items():
        setattr(m, name, value)
    return cfg


MODELS = {
    "gpt2": {},  # LayerNorm, biases, learned positions, tied embeddings
    "qwen3": {"num_query_groups": 2},  # RMSNorm, q/k norms, untied head
    "llama MoE": {"num_query_groups": 2, "num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 16,
                  "moe_shared_expert_size": 16, "moe_shared_expert_gate": True, "moe_aux_loss_coeff": 0.01},
    # attention sinks, a window of 5 (of 16) on layer 0, biased router and experts
    "gpt_oss": {"num_query_groups": 2, "num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 16,
                "sliding_window": 5, "sliding_window_layers": [0]},
}


def _gradients(cfg: Config, split: bool, recompute: str, deferring: bool) -> dict[str, torch.Tensor]:
    """Two micro batches' gradients of a model built for a schedule that splits its backward (`split`), each
    backward run fused or, `deferring`, as a B (checked to leave every weight gradient for later) and its W."""
    model = GPTModel(cfg.model, torch.device("cpu"), ParallelContext(), seed=3)
    apply_recompute(model, recompute)
    if split:
        apply_split_backward(model)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 100, (2, 16), generator=g) for _ in range(2))
    for microbatch in range(2):
        loss = model(tokens.roll(microbatch), labels).mean()
        if not deferring:
            loss.backward()
            continue
        queue = WeightGradients()
        with deferred(queue):
            loss.backward()
        assert microbatch or all(p.grad is None for p in model.parameters()), "B computed a weight gradient"
        queue.run()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_b_then_w_equals_the_fused_backward_bit_for_bit(family, recompute):
    cfg = _model_config(family.split()[0], **MODELS[family])
    fused, split = _gradients(cfg, True, recompute, False), _gradients(cfg, True, recompute, True)
    plain = _gradients(cfg, False, recompute, False)
    assert all(grad is not None for grad in split.values())
    for name, grad in split.items():
        assert torch.equal(grad, fused[name]), name
        if cfg.model.features.norm == "layernorm":
            assert torch.equal(grad, plain[name]), name
        else:
            torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)


def _layout(family: str, pp: int, vp: int, schedule: str, tp: int = 1, **parallel) -> Config:
    """The tiny model of tests/test_pipeline_parallel.py (8 layers, 8 micro batches of one sample per step)."""
    experts = family == "llama MoE"
    model = {"num_layers": 8, "num_attention_heads": 8, "vocab_size": 250,
             "num_query_groups": 4 if family != "gpt2" else None}
    if experts:
        model |= {"num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.01}
    train = {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": 3,
             "recompute": parallel.pop("recompute", "none")}
    return tiny_config(family.split()[0], model=model, train=train,
                       parallel={"pp": pp, "vp": vp, "tp": tp, "sequence_parallel": tp > 1,
                                 "pipeline_schedule": schedule, **parallel})


PARITY = [  # on 4 ranks: pp 2 and 4 with tp 2 + SP, cp 2, dp 2 + the distributed optimizer, ZeRO-3, expert parallelism
    ("llama", 2, 2, "zb-v", {"tp": 2}),
    ("llama", 2, 2, "zb-v", {"cp": 2}),  # ring attention's exchanges inside B, its projections' W deferred
    ("gpt2", 2, 2, "zb-h1", {"tp": 2}),  # tied embeddings, the row-parallel bias after the reduction
    ("gpt2", 2, 2, "zb-v", {"distributed_optimizer": True}),  # the tied copy next to the embedding on rank 0
    ("llama", 2, 1, "zb-h1", {"zero_stage": 3, "recompute": "full", "bucket_size": 20_000}),
    ("llama MoE", 2, 2, "zb-v", {"ep": 2, "recompute": "selective"}),
    ("llama", 4, 2, "zb-v", {"recompute": "selective"}),
    ("gpt2", 4, 1, "zb-h1", {}),
    # DualPipeV: its F&B pairs interleaved at the expert all-to-all (ep 2), recompute rerunning them inside B
    ("llama MoE", 2, 2, "dualpipev", {"tp": 2, "ep": 2}),
    ("llama MoE", 2, 2, "dualpipev", {"ep": 2, "distributed_optimizer": True, "recompute": "full"}),
    ("llama MoE", 4, 2, "dualpipev", {"recompute": "selective"}),
]


def _parity_ranks(rank: int, world_size: int) -> list:
    results = []
    for family, pp, vp, schedule, parallel in PARITY:
        cfg = _layout(family, pp, vp, schedule, **parallel)
        losses, grads = train_and_gather(cfg, cpu_topology(rank, world_size, cfg))
        results.append((losses if is_logging_rank(cfg, Topology.from_config(
            rank, world_size, torch.device("cpu"), cfg.parallel, cfg.model.num_experts > 0)) else None, grads))
    return results


@pytest.fixture(scope="module")
def one_device() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {family: on_one_device(_layout(family, 1, 1, "1f1b")) for family in ("gpt2", "llama", "llama MoE")}


def test_zero_bubble_layouts_match_one_device(one_device):
    """Losses and every gradient the optimizers stepped with, fp32, over three steps."""
    per_rank = run_ranks(4, _parity_ranks)
    for index, (family, pp, vp, schedule, parallel) in enumerate(PARITY):
        losses = next(r[index][0] for r in per_rank if r[index][0] is not None)
        assert_equals_one_device(f"{family} {schedule} pp={pp} vp={vp} {parallel}", losses, per_rank, index,
                                 one_device[family])


def test_a_compiled_layer_defers_its_weight_gradients():
    """torch.compile traces a backward ahead of time; the split goes through one opaque op that decides when it
    runs, so a compiled layer's B leaves every weight gradient to its W, which gives the eager gradients."""
    cfg = _model_config("qwen3", num_query_groups=2)
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPTModel(cfg.model, torch.device("cpu"), ParallelContext(), seed=3)
        apply_split_backward(model)
        layer = model.layers["0"]
        if compiled:
            layer.compile()
        x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = layer(x, None)
        queue = WeightGradients()
        with deferred(queue):
            out.square().sum().backward()
        assert x.grad is not None and all(p.grad is None for p in layer.parameters()), compiled
        assert len(queue.work) == sum(1 for _ in layer.parameters()), compiled
        queue.run()
        grads.append({name: p.grad for name, p in layer.named_parameters()} | {"input": x.grad})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


TINY = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8", "--model.seq_length=32",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=6",
        "--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0"]


def test_checkpoints_move_between_v_schedules_and_interleaved_1f1b_and_the_trace_shows_w_and_pairs(tmp_path):
    """ZB-V and DualPipeV place layers in a V, interleaved 1F1B in a loop; checkpoints name layers globally, so a
    run saved under one resumes under the other, both ways, on the one-device run's losses. ZB-V's trace
    (Perfetto) has a W box for every chunk and micro batch on every rank; DualPipeV's every F and B once, a W
    for each B that left one, and each F&B pair's backward on the rank's second row beside its forward."""
    ckpt = [f"--checkpoint.save={tmp_path / 'ckpt'}", f"--checkpoint.load={tmp_path / 'ckpt'}"]
    traces = {"zb-v": tmp_path / "zb-v.json", "dualpipev": tmp_path / "dualpipev.json"}
    reference = [r["loss"] for r in tiny_run(tmp_path, 1, "--train.train_iters=8", base=TINY, name="one")]
    layout = ["--parallel.pp=2", "--parallel.vp=2", "--train.exit_interval=2", "--train.train_iters=8", *ckpt]
    losses = []
    for step, schedule in enumerate(("zb-v", "1f1b", "dualpipev", "1f1b")):
        extra = [f"--logging.pipeline_trace={traces[schedule]}", "--logging.pipeline_trace_steps=1"] if (
            step in (0, 2)) else []
        records = tiny_run(tmp_path, 2, *layout, f"--parallel.pipeline_schedule={schedule}", *extra, base=TINY,
                           name=f"{schedule}{step}")
        losses += [r["loss"] for r in records]
    assert losses == pytest.approx(reference, rel=1e-5)
    for schedule, path in traces.items():
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        for rank in (0, 1):
            ops = schedule_ops(schedule, 2, 2, rank, 4)
            mine = [e for e in events if e["pid"] == rank]
            assert Counter(e["name"] for e in mine) == Counter(part.label for op in ops for part in op.parts), rank
            pairs = [e for e in mine if e["args"]["paired"]]
            assert len(pairs) == 2 * sum(len(op.parts) == 2 for op in ops), rank
            assert all(e["tid"] == (e["cat"] == "B") for e in pairs) and all(e["tid"] == 0 for e in mine
                                                                             if not e["args"]["paired"])
