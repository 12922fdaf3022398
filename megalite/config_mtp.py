"""Multi-token prediction's config fields (Megatron-LM's names and meanings) and what they ask of a run.

DeepSeek-V3 (section 2.2 of its report) predicts, beside the next token, the tokens after it: depth k of
model.mtp_num_layers combines the previous depth's hidden state with the embedding of the token k ahead, runs one
more transformer layer of the model's kind, and scores the token k + 1 ahead with the shared output head
(model/mtp.py). Its losses join the LM loss scaled by mtp_loss_scaling_factor / mtp_num_layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config_sections import documented as _f

if TYPE_CHECKING:
    from megalite.config import Config


@dataclass
class MultiTokenPredictionFields:
    """The model section's multi-token-prediction fields (ModelConfig inherits them)."""

    mtp_num_layers: int = _f(
        0, "multi-token prediction depths (DeepSeek-V3: 1): depth k predicts the token k + 1 ahead from depth k - 1's "
           "hidden state and the embedding of the token k ahead, through one more layer of the model's kind (dense "
           "or experts, as layer num_layers + k - 1 would be), the embedding and output head shared; 0: none")
    mtp_loss_scaling_factor: float = _f(
        0.1, "multi-token prediction: the depths' losses join the LM loss times this / mtp_num_layers (Megatron-LM's "
             "default 0.1; DeepSeek-V3 0.3 for its first 10T tokens, then 0.1)")


def mtp_errors(cfg: Config, world_size: int) -> list[str]:
    """The multi-token-prediction fields' problems, each with its fix."""
    m, errors = cfg.model, []
    if m.mtp_num_layers < 0:
        errors.append(f"model.mtp_num_layers={m.mtp_num_layers} must be >= 0 (0: no multi-token prediction)")
    elif m.mtp_num_layers >= m.seq_length:
        errors.append(f"model.mtp_num_layers={m.mtp_num_layers} must be < model.seq_length={m.seq_length}: depth k "
                      "predicts the token k + 1 ahead inside the training window")
    if m.mtp_loss_scaling_factor < 0:
        errors.append(f"model.mtp_loss_scaling_factor={m.mtp_loss_scaling_factor} must be >= 0")
    return errors
