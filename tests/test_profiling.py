"""The profiler on a CPU toy loop: it records exactly the asked-for steps on the asked-for ranks,
writes a Chrome trace and an operator table, survives an early stop, and explains itself."""

from __future__ import annotations

import json

import pytest
import torch

from megalite.config import ConfigError, LoggingConfig
from megalite.config_cli import parse_config
from megalite.training.profiling import Profiler, profile_config_errors

CPU = torch.device("cpu")


def _train(profiler: Profiler, steps: range) -> None:
    """A tiny model trained a few steps, reporting each step to the profiler like the training loop."""
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        profiler.step_started(step)
        loss = model(torch.randn(4, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        profiler.step_finished(step)
    profiler.close()


def _step_ranges(trace_file) -> set[str]:
    events = json.loads(trace_file.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("megalite step")}


def test_records_only_the_chosen_steps(tmp_path):
    cfg = LoggingConfig(profile_steps=[2, 3], profile_dir=str(tmp_path))
    _train(Profiler(cfg, rank=0, device=CPU), range(1, 6))
    trace = tmp_path / "rank0_steps2-3.pt.trace.json"
    assert _step_ranges(trace) == {"megalite step 2", "megalite step 3"}
    assert any(e.get("name") == "aten::addmm" for e in json.loads(trace.read_text())["traceEvents"])
    assert "aten::addmm" in (tmp_path / "rank0_steps2-3.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_steps2-3.pt.trace.json", "rank0_steps2-3.txt"]


def test_other_ranks_record_nothing(tmp_path):
    cfg = LoggingConfig(profile_steps=[1, 2], profile_ranks=[1], profile_dir=str(tmp_path / "profiles"))
    _train(Profiler(cfg, rank=0, device=CPU), range(1, 4))
    assert not (tmp_path / "profiles").exists()
    _train(Profiler(cfg, rank=1, device=CPU), range(1, 4))
    assert (_step_ranges(tmp_path / "profiles" / "rank1_steps1-2.pt.trace.json")
            == {"megalite step 1", "megalite step 2"})


def test_a_run_that_stops_inside_the_range_still_writes_its_trace(tmp_path):
    """A run resumed at step 4 and stopped after step 5 records what it ran of [3, 8]."""
    cfg = LoggingConfig(profile_steps=[3, 8], profile_dir=str(tmp_path))
    _train(Profiler(cfg, rank=0, device=CPU), range(4, 6))
    assert _step_ranges(tmp_path / "rank0_steps4-5.pt.trace.json") == {"megalite step 4", "megalite step 5"}


def test_memory_snapshot_on_cpu_is_a_notice_once(tmp_path, capsys):
    cfg = LoggingConfig(memory_snapshot=str(tmp_path / "snapshot.pickle"))
    _train(Profiler(cfg, rank=0, device=CPU), range(1, 4))
    err = capsys.readouterr().err
    assert err.count("logging.memory_snapshot needs a CUDA device") == 1
    assert not (tmp_path / "snapshot.pickle").exists()


@pytest.mark.parametrize("fields,world,message", [
    ({"profile_steps": [3, 2]}, 2, "logging.profile_steps=[3, 2] must be [first, last]"),
    ({"profile_steps": [0, 2]}, 2, "1 <= first <= last"),
    ({"profile_steps": [5]}, 2, "must be [first, last]"),
    ({"profile_ranks": [0, 4]}, 4, "logging.profile_ranks=[0, 4] lists ranks outside the job (world size 4)"),
    ({"profile_ranks": [0, 1], "memory_snapshot": "snap.pickle"}, 2, "put '{rank}' in the path"),
])
def test_bad_settings_are_named(fields, world, message):
    errors = profile_config_errors(LoggingConfig(**fields), world)
    assert len(errors) == 1 and message in errors[0]


def test_profiler_refuses_a_bad_range():
    with pytest.raises(ConfigError, match=r"logging.profile_steps=\[4, 1\]"):
        Profiler(LoggingConfig(profile_steps=[4, 1]), rank=0, device=CPU)


def test_command_line_sets_the_fields():
    cfg = parse_config(["--logging.profile_steps=[5, 6]", "--logging.profile_ranks", "0,3",
                        "--logging.memory_snapshot=snap_{rank}.pickle"])
    assert (cfg.logging.profile_steps, cfg.logging.profile_ranks) == ([5, 6], [0, 3])
    assert profile_config_errors(cfg.logging, 4) == []
