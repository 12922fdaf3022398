"""Muon, the update rule for hidden weight matrices (Keller Jordan; Moonlight's scaling), at every layout.

Per element, where Adam's state would live (this rank's owned slices, main_weights.py): Nesterov momentum as
torch.optim.Muon keeps it (buf <- lerp(buf, g, 1 - mu); update <- lerp(g, buf, mu)). Per matrix: the quintic
Newton-Schulz iteration on update / ||update||_F (transposed when tall), scaled by 0.2 * sqrt(max(A, B))
(`rms`, Moonlight: the update RMS of AdamW, so its learning rate and weight decay carry over) or
sqrt(max(1, A / B)) (`spectral`, Keller Jordan's); decoupled weight decay lr * wd, as torch applies it.

Each matrix is the one transformers has: megalite's fused weights are split as their placement says
(placement.py `separate_rows`: QKV into q, k and v, or each head's rows with `optim.muon_split_heads`;
gate/up into two; a stack of experts into each expert). The updates travel to one owner rank per unit and back
(muon_plan.py), so the iteration runs once per matrix whatever the layout.

Precision: in `dtype`, bf16 as released (torch.optim.Muon always iterates in bf16; the pieces travel in
bf16 too, which changes nothing since the iteration starts by rounding to it) or fp32, which fp32 training
uses so that layouts can be compared tightly. A step whose gradient norm is NaN/Inf (`found_inf`, a device
tensor) keeps weights and momentum as they were, decided on the device with no host read.
"""

from __future__ import annotations

import math

import torch

from megalite.parallel.muon_plan import MuonPlan

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's
EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a matrix (the same operations in the same order) in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def update_scale(rows: int, cols: int, rule: str) -> float:
    """The factor on a rows x cols matrix's orthogonalised update (torch's adjust_lr_fn `match_rms_adamw` for rms,
    `original` for spectral)."""
    return 0.2 * math.sqrt(max(rows, cols)) if rule == "rms" else math.sqrt(max(1.0, rows / cols))


def orthogonalize(whole: torch.Tensor, separate: list[torch.Tensor] | None, steps: int, dtype: torch.dtype,
                  rule: str) -> torch.Tensor:
    """The scaled, orthogonalised update of every separate matrix (`separate`: their row indices, None: the whole
    matrix) of each matrix of a whole unit [..., rows, cols], in fp32."""
    rows, cols = whole.shape[-2:]
    out = torch.empty(whole.shape, dtype=torch.float32, device=whole.device)
    for matrix, result in zip(whole.reshape(-1, rows, cols), out.view(-1, rows, cols)):
        for index in separate or [slice(None)]:
            g = matrix[index]
            result[index] = newton_schulz(g, steps, dtype).float() * update_scale(*g.shape, rule)
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon over this rank's flat main slices of hidden matrices (`matrices`, by parameter name; their units made
    whole on their owners by `plan`), `adamw` (torch's fused AdamW) over the rest. One torch optimizer, so its
    param groups (AdamW's, then Muon's) and its state (Adam's moments, Muon's `momentum_buffer`) are where
    checkpoints, the learning rate schedule and the memory meters look, keyed as any optimizer's."""

    def __init__(self, adamw: torch.optim.AdamW, matrices: dict[str, torch.Tensor], plan: MuonPlan, lr: float,
                 weight_decay: float, momentum: float, ns_steps: int, scale: str, per_head: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        muon = {"params": list(matrices.values()), "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                "muon": True}
        super().__init__([*adamw.param_groups, muon], {})
        self.adamw = adamw
        self._link()
        self.names = {id(t): n for n, t in matrices.items()}
        self.plan, self.ns_steps, self.scale, self.dtype, self.device = plan, ns_steps, scale, dtype, device
        self.separate = {}  # the row indices of the separate matrices of each unit this rank orthogonalises
        for unit in plan.units:
            rows = unit.separate_rows(per_head) if unit.owner == plan.rank else None
            self.separate[unit.key] = [r.to(device) for r in rows] if rows is not None else None
        self.found_inf: torch.Tensor | None = None  # set around step(), as for fused AdamW: 1.0 skips it

    def _link(self) -> None:
        """AdamW steps the first groups, in the one state."""
        self.adamw.param_groups, self.adamw.state = self.param_groups[:-1], self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        self.adamw.found_inf = self.found_inf
        self.adamw.step()
        self.adamw.found_inf = None
        group = self.param_groups[-1]
        lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
        updates, moved = {}, []
        for main in group["params"]:
            state = self.state[main]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(main)
            buf = state["momentum_buffer"]
            moved.append((main, buf, buf.lerp(main.grad, 1 - mu)))
            updates[self.names[id(main)]] = main.grad.lerp(moved[-1][2], mu)
        whole = self.plan.gather(updates, self.dtype, self.device)
        del updates
        results = {}
        for key in list(whole):  # each whole matrix freed once orthogonalised
            results[key] = orthogonalize(whole.pop(key), self.separate[key], self.ns_steps, self.dtype, self.scale)
        back = self.plan.scatter(results, self.device)
        del results
        skip = self.found_inf.bool() if self.found_inf is not None else None
        for main, buf, new_buf in moved:
            stepped = main * (1 - lr * decay) - lr * back[self.names[id(main)]].to(main.device)
            if skip is not None:
                skip = skip.to(main.device)
                new_buf, stepped = torch.where(skip, buf, new_buf), torch.where(skip, main, stepped)
            buf.copy_(new_buf)
            main.copy_(stepped)
