"""Under bf16 autocast the tensor- and sequence-parallel collectives of column-parallel layers move bf16:
norms return fp32 under autocast, and the input used to be gathered (and its gradient reduced) in fp32,
twice the bytes the matmul after it needs."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from distributed import cpu_topology, run_ranks

from megalite.parallel import layers
from megalite.planning.measure import mock_batches
from megalite.training.build import build_trainer
from megalite.training.step import train_step


def _moved_dtypes(rank: int, world_size: int, sequence_parallel: bool) -> set[tuple[str, torch.dtype]]:
    """The dtypes of what column-parallel layers hand to their collectives, forward and backward."""
    moved = set()

    def recording(name: str):
        original = getattr(layers, name)

        def collective(x: torch.Tensor, *args):
            moved.add((name, x.dtype))
            if x.requires_grad:
                x.register_hook(lambda grad: moved.add((f"{name} backward", grad.dtype)))
            return original(x, *args)
        return collective

    for name in ("sequence_parallel_linear", "copy_to_tp"):
        setattr(layers, name, recording(name))
    cfg = tiny_config("llama", parallel={"tp": 2, "sequence_parallel": sequence_parallel},
                      train={"precision": "bf16"})
    with build_trainer(cfg, cpu_topology(rank, world_size, tp=2)) as trainer:
        train_step(trainer, mock_batches(cfg, 1, seed=0))
    return moved


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_collectives_move_the_compute_dtype(sequence_parallel):
    name = "sequence_parallel_linear" if sequence_parallel else "copy_to_tp"
    for moved in run_ranks(2, _moved_dtypes, sequence_parallel):
        assert moved == {(name, torch.bfloat16), (f"{name} backward", torch.bfloat16)}
