"""megalite/planning/measure.py, the helpers the measuring tools share: the config a tool measures with and the
mock batches it trains on. (rank_memory and saved_storages are held to the planner in tests/test_plan.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.config import ConfigError
from megalite.planning.measure import measurement_config, mock_batches, param_dtype_fields

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2_125m.yaml"


def test_a_measurement_runs_the_example_on_mock_data_and_saves_nothing():
    cfg = measurement_config(8, EXAMPLE, parallel={"tp": 2}, train={"micro_batch_size": 1})
    assert (cfg.model.num_layers, cfg.parallel.tp, cfg.train.micro_batch_size) == (12, 2, 1)
    assert cfg.data.mock and cfg.data.paths is None and cfg.data.tokenizer_type is None
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.train.device) == (None, None, "cpu")


def test_a_measurement_config_is_checked():
    with pytest.raises(ConfigError, match="model.num_layers"):
        measurement_config(1, model={"num_layers": "four"})
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        measurement_config(3, parallel={"tp": 2})


def test_param_dtype_option():
    assert param_dtype_fields(None) == {}
    assert param_dtype_fields("fp32") == {"param_dtype": "fp32"}
    assert param_dtype_fields("bf16") == {"param_dtype": "bf16", "precision": "bf16"}


def test_mock_batches_are_fixed_and_differ_by_data_parallel_rank():
    cfg = measurement_config(1, model={"seq_length": 16, "vocab_size": 300}, train={"micro_batch_size": 2})
    first, second = mock_batches(cfg, 2), mock_batches(cfg, 2, dp_rank=1)
    assert [tuple(b.tokens.shape) for b in first] == [(2, 16), (2, 16)]
    assert torch.equal(first[1].tokens, mock_batches(cfg, 2)[1].tokens)
    assert not torch.equal(first[0].tokens, second[0].tokens)
    assert not torch.equal(first[0].tokens, mock_batches(cfg, 2, seed=7)[0].tokens)
