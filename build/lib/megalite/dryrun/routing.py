"""Balanced routing in place of the one value a fake tensor cannot give: the dropless all-to-all's split sizes.

The all-to-all dispatcher reads on the host how many rows go to each expert-parallel rank (model/moe/
dispatch.py AllToAll.split_sizes); fake tensors hold no counts. The dry run assumes what the planner assumes
(planning/experts.py): every expert gets the same share of the (token, choice) rows, on every rank, so a rank
sends rows/ep to each expert-parallel rank (the remainder to the first ones), gets as many from each as it
keeps for itself, and each expert-tensor-parallel rank holds all the rows its ep group got.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megalite.config import ModelConfig
from megalite.model.moe.dispatch import AllToAll, Sorted


def balanced_split_sizes(dispatcher: AllToAll, pairs: Sorted, received: torch.Tensor,
                         blocks: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    rows, ep = pairs.token.shape[0], dispatcher.ep.size
    sent = [rows // ep + (i < rows % ep) for i in range(ep)]
    got = [sent[dispatcher.ep.rank]] * ep
    return sent, got, [sum(got)] * dispatcher.etp.size


def check_routing(cfg: ModelConfig) -> None:
    """Refuse what balanced routing cannot stand in for: which rows a capacity keeps depends on the router's
    values (unless padded to the capacity, which needs no value)."""
    if cfg.num_experts and cfg.moe_capacity_factor is not None and not cfg.moe_pad_to_capacity:
        raise ValueError("model.moe_capacity_factor without model.moe_pad_to_capacity: the rows an expert keeps "
                         "depend on the router's values, which the dry run's fake tensors do not have; dry-run the "
                         "layout with --model.moe_pad_to_capacity=true (the same sizes at balanced routing)")


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside the block the all-to-all dispatcher takes balanced split sizes instead of reading the device."""
    original = AllToAll.split_sizes
    AllToAll.split_sizes = balanced_split_sizes
    try:
        yield
    finally:
        AllToAll.split_sizes = original
