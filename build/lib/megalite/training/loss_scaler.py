"""Dynamic loss scaling for fp16 (Megatron's policy): halve on overflow after `hysteresis`
overflows, double after `window` clean steps, never below `min_scale`.

For fp32 and bf16 the scale is a constant 1 and nothing is skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megalite.config import OptimConfig


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    hysteresis_left: int = 2
    clean_steps: int = 0

    @classmethod
    def for_precision(cls, precision: str, cfg: OptimConfig) -> LossScaler:
        if precision != "fp16":
            return cls()
        return cls(cfg.initial_loss_scale, True, cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis,
                   cfg.hysteresis)

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide grads by the scale in place; True when any is inf/nan (the step must be skipped)."""
        if not self.dynamic or not grads:
            return False
        found_inf = torch.zeros(1, device=grads[0].device)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return bool(found_inf.item())

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
