"""Shared test helpers: tiny configs and a one-thread torch, as CI has 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.config import Config

torch.set_num_threads(1)


def tiny_config(family: str = "gpt2", **sections: dict) -> Config:
    """A model that trains in well under a second per step on one CPU thread."""
    cfg = Config()
    cfg.model.family = family
    cfg.data.mock = True
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2, 64, 4
    cfg.model.seq_length, cfg.model.vocab_size = 32, 300
    if family == "llama":
        cfg.model.num_query_groups = 2
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.train_iters = 2, 4, 4
    cfg.logging.progress_bar, cfg.logging.log_interval = False, 1
    for section, values in sections.items():
        for name, value in values.items():
            setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.fixture
def tiny():
    return tiny_config


ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.fixture(scope="session")
def assets() -> Path:
    """Real tokenizer files and text fetched by scripts/get_assets.sh (scripts/test.sh runs it)."""
    if not (ASSETS / "SHA256SUMS.ok").exists():
        pytest.fail(f"test assets missing under {ASSETS}: run `bash scripts/get_assets.sh` (scripts/test.sh does)")
    return ASSETS


@pytest.fixture(scope="session")
def trained_checkpoint(assets, tmp_path_factory):
    """family -> root of a checkpoint trained at tp=2 x pp=2 on Shakespeare (tests/trained.py),
    built once per session."""
    from trained import train_tp2_pp2

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = train_tp2_pp2(family, assets, tmp_path_factory.mktemp(f"trained-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[float]]:
    """One device's losses of the tiny parity runs (tests/parity.py), gpt2 and llama."""
    from parity import LLAMA, clipped_run

    tmp = tmp_path_factory.mktemp("reference")
    return {"gpt2": clipped_run(tmp, 1, name="gpt2"), "llama": clipped_run(tmp, 1, *LLAMA, name="llama")}
