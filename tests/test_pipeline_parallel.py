"""Pipeline parallelism: the schedules (each op once, the memory bound, no deadlock), and
pp x vp x tp layouts equal to one device over three optimizer steps, for both families."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, pretrain_torchrun, run_ranks, tiny_run
from parity import assert_equals_one_device, train_and_gather

from megalite.parallel.pipeline.plan import communication_plan, needs
from megalite.parallel.pipeline.registry import schedule_ops
from megalite.parallel.pipeline.stage import PipelineStage
from megalite.parallel.topology import Topology, release_process_groups

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ([(pp, vp, m) for pp in (2, 4, 8) for vp in (1, 2, 3) for m in (pp, 2 * pp, 3 * pp)]
           + [(2, 1, 3), (4, 1, 2), (4, 1, 7)])


def _warmup(pp: int, vp: int, rank: int, m: int) -> int:
    if vp == 1:
        return min(pp - rank - 1, m)
    return m * vp if m == pp else min((pp - rank - 1) * 2 + (vp - 1) * pp, m * vp)


@pytest.mark.parametrize("pp, vp, m", LAYOUTS)
def test_each_op_once_and_activation_bound(pp, vp, m):
    for rank in range(pp):
        ops = schedule_ops("1f1b", pp, vp, rank, m)
        assert Counter(ops) == Counter((k, c, i) for k in "FB" for c in range(vp) for i in range(m))
        stored, peak = set(), 0
        for kind, chunk, mb in ops:
            if kind == "F":
                stored.add((chunk, mb))
            else:
                stored.remove((chunk, mb))
            peak = max(peak, len(stored))
        assert peak == min(_warmup(pp, vp, rank, m) + 1, m * vp)


@pytest.mark.parametrize("pp, vp, m", LAYOUTS)
def test_no_deadlock(pp, vp, m):
    """Run every rank's list, an op only once the op producing its input has run on the neighbour."""
    ops = {r: schedule_ops("1f1b", pp, vp, r, m) for r in range(pp)}
    done, position = set(), dict.fromkeys(range(pp), 0)

    def ready(rank: int, op) -> bool:
        kind, chunk, mb = op
        if kind == "F":
            first = rank == 0 and chunk == 0
            return first or (((rank - 1) % pp, "F", chunk - (rank == 0), mb) in done)
        last = rank == pp - 1 and chunk == vp - 1
        return last or (((rank + 1) % pp, "B", chunk + (rank == pp - 1), mb) in done)

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            if position[r] < len(ops[r]) and ready(r, ops[r][position[r]]):
                done.add((r, *ops[r][position[r]]))
                position[r] += 1
                progress = True
    assert all(position[r] == len(ops[r]) for r in range(pp)), f"deadlock at {position}"


def _config(family: str, pp: int, vp: int, tp: int, sp: bool, first: int | None = None, last: int | None = None):
    overrides = {"num_layers": 8, "num_attention_heads": 8, "vocab_size": 250,
                 "num_query_groups": 4 if family == "llama" else None}
    parallel = {"pp": pp, "vp": vp, "tp": tp, "sequence_parallel": sp, "first_stage_layers": first,
                "last_stage_layers": last}
    return tiny_config(family, model=overrides, parallel=parallel,
                       train={"micro_batch_size": 1, "global_batch_size": 8, "train_iters": 3})


def _train(cfg, topology: Topology) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three steps; returns this rank's step losses and its full gradients by one-device name."""
    return train_and_gather(cfg, topology, steps=3)


CASES = {2: [(f, 2, vp, 1, False) for f in ("gpt2", "llama") for vp in (1, 2)] + [("gpt2", 2, 1, 1, False, 3, 5)],
         4: [(f, 4, vp, 1, False) for f in ("gpt2", "llama") for vp in (1, 2)]
            + [(f, 2, vp, 2, vp == 2) for f in ("gpt2", "llama") for vp in (1, 2)],
         8: [(f, 4, vp, 2, vp == 2) for f in ("gpt2", "llama") for vp in (1, 2)]}


def _rank_run(rank: int, world_size: int) -> list:
    results = []
    for family, pp, vp, tp, *rest in CASES[world_size]:
        topology = cpu_topology(rank, world_size, tp=tp, pp=pp)
        results.append(_train(_config(family, pp, vp, tp, *rest), topology))
    return results


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    refs = {}
    for family in ("gpt2", "llama"):
        topology = Topology.from_environment("cpu")
        try:
            refs[family] = _train(_config(family, 1, 1, 1, False), topology)
        finally:
            release_process_groups()
    return refs


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_pipeline_layouts_match_one_device(world_size, references):
    per_rank = run_ranks(world_size, _rank_run)
    for index, (family, pp, vp, tp, *rest) in enumerate(CASES[world_size]):
        assert_equals_one_device(f"{family} pp={pp} vp={vp} tp={tp} sp/first/last={rest}",
                                 per_rank[world_size - 1][index][0], per_rank, index, references[family])


def test_trace_shows_every_op_once_per_step(tmp_path):
    trace = tmp_path / "trace.json"
    args = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8",
            "--model.seq_length=32", "--model.vocab_size=250", "--train.micro_batch_size=1",
            "--train.global_batch_size=4", "--train.train_iters=3", "--logging.progress_bar=false", "--data.mock=true",
            "--data.num_workers=0", "--parallel.pp=2", "--parallel.vp=2", f"--logging.pipeline_trace={trace}",
            "--logging.pipeline_trace_steps=2"]
    pretrain_torchrun(2, args)
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        ops = Counter(e["name"] for e in events if e["pid"] == rank and e["ph"] == "X")
        assert ops == Counter({f"{k} c{c} mb{m}": 2 for k, c, m in itertools.product("FB", range(2), range(4))})
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert "peak stored activations 5" in names[0] and "peak stored activations 3" in names[1]


TINY = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=8", "--model.seq_length=32",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=4",
        "--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0"]


def _run(tmp_path: Path, nproc: int, *extra: str) -> list[float]:
    return [r["loss"] for r in tiny_run(tmp_path, nproc, *extra, base=TINY)]


def test_checkpoint_saved_at_tp2_pp2_vp2_resumes_on_one_device(tmp_path):
    ckpt = [f"--checkpoint.save={tmp_path / 'ckpt'}", f"--checkpoint.load={tmp_path / 'ckpt'}"]
    reference = _run(tmp_path, 1)
    first = _run(tmp_path, 4, "--parallel.tp=2", "--parallel.pp=2", "--parallel.vp=2", "--train.exit_interval=2", *ckpt)
    assert first + _run(tmp_path, 1, *ckpt) == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("pp, vp, m", LAYOUTS)
def test_communication_plan_receives_at_most_a_few_messages_ahead(pp, vp, m):
    """Each message is posted by sender and receiver in the same round, before the op that needs it;
    a rank holds at most 4 received messages its next operations have not consumed yet."""
    plans = communication_plan("1f1b", pp, vp, m)
    for rank in range(pp):
        stage, held, peak = PipelineStage(pp, vp, rank), set(), 0
        for index, op in enumerate(schedule_ops("1f1b", pp, vp, rank, m)):
            held |= {msg for rounds in plans[rank][index] for msg in rounds if msg.dst == rank}
            peak = max(peak, len(held))
            need = needs(stage, op)
            assert need is None or need in held, f"rank {rank} op {op} runs before {need} arrives"
            held.discard(need)
        assert not held and peak <= 4, (rank, peak)
