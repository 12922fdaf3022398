"""W&B never costs a training run: a missing key is refused before anything starts, an unreachable
server or a crashed W&B process leaves training untouched and logging offline (every step kept,
the fallback recorded, the delay bounded by logging.wandb_timeout), and a resumed run keeps its
W&B run id. No network: W&B is pointed at a closed local port."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import tiny_config
from wandb_records import read_run

from megalite.config import ConfigError
from megalite.config_validation import validate
from megalite.parallel.spawn import free_port
from megalite.training.pretrain import pretrain
from megalite.training.wandb_logger import WandbLogger

TIMEOUT = 15.0


@pytest.fixture
def unreachable_wandb(monkeypatch, tmp_path):
    """An API key, but the server is a local port nobody listens on."""
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))


def _config(tmp_path: Path, mode: str = "online", **train):
    return tiny_config(train={"train_iters": 6, **train}, checkpoint={"save": str(tmp_path / "ckpt")},
                       logging={"wandb_project": "megalite-test", "wandb_mode": mode, "wandb_timeout": TIMEOUT,
                                "metrics_file": str(tmp_path / "metrics.jsonl")})


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_online_without_a_key_is_refused_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError) as refused:
        pretrain(_config(tmp_path))
    message = str(refused.value)
    assert ("wandb login" in message and "WANDB_API_KEY" in message
            and "--logging.wandb_mode=offline" in message), message
    assert not dist.is_initialized() and not (tmp_path / "ckpt").exists()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "0" * 40 + "\n")
    validate(_config(tmp_path), 1)  # what `wandb login` writes is enough


def test_an_unreachable_server_falls_back_to_offline_within_the_bound(unreachable_wandb, tmp_path):
    begin = time.monotonic()
    plain = pretrain(tiny_config(train={"train_iters": 6}))
    without = time.monotonic() - begin
    begin = time.monotonic()
    result = pretrain(_config(tmp_path))
    delay = time.monotonic() - begin - without
    assert sorted(result.losses) == list(range(1, 7)) and result.losses == pytest.approx(plain.losses, rel=1e-6)
    logged = [r["_step"] for r in read_run(Path(result.wandb_dir).parent)["history"]]
    assert logged == list(range(1, 7))
    fallback = [r for r in _records(tmp_path) if r.get("wandb_fallback") == "offline"]
    assert len(fallback) == 1 and fallback[0]["sync_command"] == f"wandb sync {Path(result.wandb_dir).parent}", fallback
    assert delay < TIMEOUT, f"W&B delayed the run by {delay:.1f} s (logging.wandb_timeout={TIMEOUT})"


def test_a_resumed_run_continues_the_same_wandb_run(unreachable_wandb, tmp_path):
    first = pretrain(_config(tmp_path, exit_interval=3))
    second = pretrain(_config(tmp_path))
    assert first.wandb_run_id and second.wandb_run_id == first.wandb_run_id
    assert [r["_step"] for r in read_run(Path(second.wandb_dir).parent)["history"]] == [4, 5, 6]


def test_a_crashed_wandb_process_leaves_training_untouched(tmp_path, monkeypatch):
    """The W&B process is killed at step 3, inside the logging call, so the crash lands while 17 steps
    are still to run however fast they go (a watcher thread could lose the race to a finished run)."""
    log = WandbLogger.log

    def log_after_a_crash(self: WandbLogger, record: dict, step: int) -> None:
        if step == 3 and self.restarts == 0:
            self.process.kill()
            self.process.join()
        log(self, record, step)

    monkeypatch.setattr(WandbLogger, "log", log_after_a_crash)
    result = pretrain(_config(tmp_path, "offline", train_iters=20))
    assert sorted(result.losses) == list(range(1, 21))
    assert [r["_step"] for r in read_run(Path(result.wandb_dir).parent)["history"]] == list(range(1, 21))
    assert any("exited" in r.get("reason", "") for r in _records(tmp_path) if "wandb_fallback" in r)
