"""The layout search (megalite/planning/search.py, step_time.py, traffic.py; tools/plan.py --search): every candidate
is a config the validator accepts, the traffic it times is what the dry run records, and a small case ranks as
worked out by hand."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from released_configs import RELEASED

from megalite.config_validation import validate
from megalite.dryrun.run import dry_run
from megalite.planning.cluster import Cluster
from megalite.planning.measure import measurement_config
from megalite.planning.memory import grid_replicas
from megalite.planning.search import candidates, search
from megalite.planning.search_report import exact_time
from megalite.planning.step_time import peak_flops
from megalite.planning.traffic import gradient_buffers, step_traffic
from megalite.training.flops import hardware_flops_per_token

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "seq_length": 32, "vocab_size": 256}
GROUP_AXES = {"tensor-parallel": "tp", "context-parallel": "cp", "pipeline-pair": "pp", "data-parallel": "dp",
              "expert-tensor-parallel": "etp", "expert-tensor-and-expert-parallel": "ep",
              "data-and-context-parallel": "dp", "expert-parallel": "ep", "expert-data-parallel": "edp"}
MOE = {"num_experts": 4, "moe_topk": 2}
LATENT = {"num_query_groups": None, "multi_latent_attention": True, "q_lora_rank": 8, "kv_lora_rank": 8,
          "qk_head_dim": 16, "qk_pos_emb_head_dim": 4, "v_head_dim": 16, "seq_length": 64}
CALLS = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter", "all_reduce": "all_reduce",
         "batch_isend_irecv": "send", "all_to_all_single": "all_to_all"}


def tiny(world_size: int, **sections: dict):
    return measurement_config(world_size, model=TINY_MODEL, **sections)


def test_every_candidate_is_a_config_the_validator_accepts():
    cfg = tiny(1, train={"micro_batch_size": 1, "global_batch_size": 16})
    cluster = Cluster(2, 4)
    timed, considered, pruned = candidates(cfg, cluster, 0.4)
    assert timed and considered == len(timed) + pruned
    for candidate in timed:
        validate(candidate.cfg, cluster.world_size)  # raises ConfigError otherwise
        assert candidate.cfg.parallel.tp <= cluster.gpus_per_node
    layouts = {(c.cfg.parallel.tp, c.cfg.parallel.pp, c.cfg.parallel.zero) for c in timed}
    assert {(1, 1, 1), (2, 2, 3), (2, 4, 2)} <= layouts


def test_expert_layouts_enumerated_are_configs_the_validator_accepts():
    """ep over the experts' divisors, etp at 1 or tp, each candidate validated."""
    cfg = measurement_config(1, model={**TINY_MODEL, **MOE}, train={"micro_batch_size": 1, "global_batch_size": 16})
    timed = candidates(cfg, Cluster(1, 4), 0.4)[0]
    for candidate in timed:
        validate(candidate.cfg, 4)
    shapes = {(c.cfg.parallel.tp, c.cfg.parallel.ep, c.cfg.parallel.etp) for c in timed}
    assert {(1, 4, 1), (2, 2, 2), (2, 2, 1), (2, 4, 1)} <= shapes
    assert all(etp in (1, tp) for tp, _, etp in shapes)


def recorded(run) -> dict[tuple[str, str], int]:
    """The dry run's bytes of each (axis, call) of a rank's step."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for call in run.calls:
        if call.desc in GROUP_AXES:
            totals[(GROUP_AXES[call.desc], CALLS[call.name])] += call.payload
    return dict(totals)


@pytest.mark.parametrize("world_size, parallel, recompute, model", [
    (8, {"tp": 2, "pp": 2, "sequence_parallel": True, "distributed_optimizer": True}, "none", {}),
    (16, {"tp": 2, "pp": 2, "cp": 2, "sequence_parallel": True, "distributed_optimizer": True}, "full", {}),
    (8, {"tp": 2, "pp": 2, "zero_stage": 0}, "selective", {}),
    (4, {"ep": 2}, "none", MOE),
    (4, {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 2}, "full",
     {**MOE, **LATENT, "moe_shared_expert_size": 32}),
    (4, {"tp": 2, "sequence_parallel": True, "ep": 2, "moe_dispatcher": "allgather"}, "selective", MOE),
    (4, {"cp": 2, "pp": 2}, "selective", LATENT),
])
def test_predicted_traffic_is_what_the_dry_run_records(world_size, parallel, recompute, model):
    """Every axis's bytes per step on each simulated rank equal the recorded calls' (experts' all-to-alls and
    all-gathers over ep and etp, latent attention's narrow gathers and its ring's K/V included); what the
    prediction leaves out is only the small all-reduces (the loss's, the norm's, partial norm and down-projection
    weights'), under 1% of the step's bytes."""
    cfg = measurement_config(world_size, model={**TINY_MODEL, **model}, parallel=parallel,
                             train={"micro_batch_size": 2, "global_batch_size": max(world_size, 8), "precision": "bf16",
                                    "param_dtype": "bf16", "recompute": recompute})
    report = dry_run(cfg, world_size, "all")
    assert report.ok, report.failures
    for run in report.ranks:
        pp_rank = run.role.pp_rank
        buffers = gradient_buffers(report.cfg, world_size, pp_rank)
        predicted = {(t.axis, t.call): t.payload for t in step_traffic(
            report.cfg, pp_rank, buffers, grid_replicas(report.cfg, world_size), report.microbatches)}
        measured = recorded(run)
        exact = {key: n for key, n in predicted.items() if key[1] != "all_reduce"}
        assert {key: measured.get(key) for key in exact} == exact, run.role.name
        small = {key: measured[key] - predicted[key] for key in set(predicted) - set(exact)}  # same group and call
        small |= {key: n for key, n in measured.items() if key not in predicted}
        assert all(call == "all_reduce" and n >= 0 for (_, call), n in small.items()), small
        assert sum(small.values()) < 0.01 * sum(measured.values())


def test_a_small_case_ranks_as_worked_out_by_hand():
    """One node of 4 GPUs, a 4-layer model of hidden size 1024 on 2048-token samples. By hand: dp4 (ZeRO 1) runs
    4 micro batches of a whole sample each and waits for its gradients' reduce-scatter beyond the last backward's
    two thirds and for the parameters' all-gather; tp2 x dp2 runs 8 micro batches of half the FLOPs, each waiting
    for 26 all-gathers and 18 reduce-scatters of [2048, 1024] bf16 over 2 ranks, and reduces half the gradients
    over 2 ranks. The search times both as computed here and ranks them in that order."""
    model = dict(TINY_MODEL, hidden_size=1024, num_attention_heads=16, num_query_groups=8, seq_length=2048)
    cfg = measurement_config(4, model=model, train={"micro_batch_size": 1, "global_batch_size": 16,
                                                    "precision": "bf16", "param_dtype": "bf16"})
    cluster, mfu = Cluster(1, 4, "h100"), 0.5
    bandwidth = 900 / 2 * 1e9 * 0.8  # NVLink 4, one direction, at 80%
    per_sample = hardware_flops_per_token(cfg.model, "none") * 2048 / (peak_flops(cfg, "h100") * mfu)

    def by_hand(tp: int) -> float:
        dp, m = 4 // tp, 16 // (4 // tp)
        compute = per_sample / tp
        tp_wait = (26 + 18) * 2048 * 1024 * 2 * (tp - 1) / tp / bandwidth if tp > 1 else 0.0
        layout = layout_of(cfg, tp)
        elements = sum(gradient_buffers(layout, 4, 0)["dense"])
        reduce = elements * 4 * (dp - 1) / dp / bandwidth  # fp32 gradients
        gather = elements * 2 * (dp - 1) / dp / bandwidth  # bf16 parameters
        return m * (compute + tp_wait) + max(0.0, reduce - 2 * compute / 3) + gather

    timed = candidates(cfg, cluster, mfu)[0]
    times = {}
    for tp in (1, 2):
        match = next(c for c in timed if _is(c.cfg, tp))
        assert match.time.seconds == pytest.approx(by_hand(tp), rel=1e-5)  # the search leaves buckets' padding out
        times[tp] = timed.index(match)
    assert (times[1] < times[2]) == (by_hand(1) < by_hand(2))


def layout_of(cfg, tp: int):
    """`cfg` at tp (sequence parallel), ZeRO 1, nothing recomputed, one sample per micro batch."""
    parallel = dataclasses.replace(cfg.parallel, tp=tp, sequence_parallel=tp > 1, zero_stage=1)
    return dataclasses.replace(cfg, parallel=parallel)


def _is(cfg, tp: int) -> bool:
    p, t = cfg.parallel, cfg.train
    return (p.tp, p.cp, p.pp, p.zero, t.recompute, t.micro_batch_size) == (tp, 1, 1, 1, "none", 1)


def test_exact_time_of_the_tool_layout_and_its_terms_add_up():
    cfg = tiny(8, parallel={"tp": 2, "pp": 2, "sequence_parallel": True, "distributed_optimizer": True},
               train={"micro_batch_size": 2, "global_batch_size": 8})
    time = exact_time(cfg, Cluster(2, 4), 0.4)
    assert sum(time.terms().values()) == pytest.approx(time.seconds)
    slow = exact_time(cfg, Cluster(2, 4, network_gbits=1.0), 0.4)
    assert slow.seconds > time.seconds  # pp crosses nodes: 4 ranks per node, tp x dp = 4 fills one


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_the_tool_searches_explains_and_suggests(tmp_path):
    yaml = tmp_path / "tiny.yaml"
    yaml.write_text(json.dumps({"model": TINY_MODEL, "train": {"global_batch_size": 16}}))
    found = _tool("--config", str(yaml), "--nodes", "1", "--gpus-per-node", "4", "--search")
    assert found.returncode == 0, found.stderr
    assert "top layouts" in found.stdout and " 1. " in found.stdout and "why #1 wins" in found.stdout
    explained = _tool("--config", str(yaml), "--world-size", "4", "--explain", "--parallel.tp=2")
    assert explained.returncode == 0 and "tp " in explained.stdout and "step " in explained.stdout
    big = dict(TINY_MODEL, hidden_size=8192, num_attention_heads=64, num_query_groups=8, num_layers=8,
               seq_length=4096)
    yaml.write_text(json.dumps({"model": big, "train": {"global_batch_size": 8}}))
    tight = _tool("--config", str(yaml), "--world-size", "1", "--gpu", "a100-40gb")
    assert tight.returncode == 1 and "does not fit" in tight.stdout
    assert "no single change" in tight.stdout or "cheapest single changes" in tight.stdout


def test_the_tool_reads_a_hugging_face_config(tmp_path):
    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    found = _tool("--hf-config", str(tmp_path), "--world-size", "2", "--search", "--train.global_batch_size=4")
    assert found.returncode == 0, found.stderr
    assert "top layouts" in found.stdout
    unset = _tool("--hf-config", str(tmp_path), "--world-size", "2", "--search")
    assert unset.returncode == 2 and "train.global_batch_size" in unset.stderr
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    args = argparse.Namespace(config=None, hf_config=str(tmp_path))
    assert plan_tool.load_config(args, []).train.precision == "bf16"  # as released models train, unless asked
    assert plan_tool.load_config(args, ["--train.precision=fp32"]).train.precision == "fp32"
    (tmp_path / "config.json").write_text(json.dumps(RELEASED["Kimi-K2-Instruct"][0]))  # kimi_k2: no remote code
    kimi = plan_tool.load_config(args, []).model
    assert kimi.multi_latent_attention and kimi.num_experts == 384 and kimi.rope_scaling == "yarn"


def test_a_layout_search_needs_a_global_batch():
    cfg = dataclasses.replace(tiny(1), train=dataclasses.replace(tiny(1).train, global_batch_size=None))
    with pytest.raises(Exception, match="global_batch_size"):
        search(cfg, Cluster(1, 2), 0.4)
