"""Routing the dry run can stand for: fake tensors hold no router values, so the dropless all-to-all's split sizes
are those of balanced routing (model/moe/layer.py assume_balanced_routing), as the planner assumes
(planning/experts.py); a capacity that keeps rows by their values cannot be simulated."""

from __future__ import annotations

from megalite.config import ModelConfig


def check_routing(cfg: ModelConfig) -> None:
    """Refuse what balanced routing cannot stand in for: which rows a capacity keeps depends on the router's
    values (unless padded to the capacity, which needs no value)."""
    if cfg.num_experts and cfg.moe_capacity_factor is not None and not cfg.moe_pad_to_capacity:
        raise ValueError("model.moe_capacity_factor without model.moe_pad_to_capacity: the rows an expert keeps "
                         "depend on the router's values, which the dry run's fake tensors do not have; dry-run the "
                         "layout with --model.moe_pad_to_capacity=true (the same sizes at balanced routing)")
