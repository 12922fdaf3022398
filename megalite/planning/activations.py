"""Bytes autograd keeps per micro batch, and what a zero-bubble B leaves its W, read from the model each rank builds.

Each module declares what it keeps beside its code (model/costs.py): the planner sums the declarations of the
modules a pipeline chunk's forward runs (GPTModel.chunk_modules: the embedding, the layers, the final norm and the
LM head), in the rank's model built on the meta device (planning/built.py), recompute and split norms applied.
tests/test_plan.py checks these figures against the tensors autograd saves in real CPU runs.

Why declarations and not Korthikanti et al.'s 34*s*b*h closed form: megalite differs in ways that matter.
Attention is SDPA (flash), so no s^2 scores are kept and selective recompute saves only the logsumexp; q, k and
v are views of one fused QKV output; column-parallel layers under sequence parallelism keep only their local
input shard (and gather it again in backward, parallel/gemm.py); the LM head keeps its [tokens, padded vocab]
logits gradient. Every matmul runs through parallel/gemm.py, which keeps the parameter itself for backward and
casts it to the compute dtype inside the matmul: fp32 parameters under bf16 autocast leave no bf16 weight copies
behind.

Sizes: tokens = seq/cp x micro batch (context parallelism gives each rank seq/cp tokens of every sample, and every
term is per token: flash attention is linear in s); a tensor inside the tensor-parallel region has its heads / MLP
width divided by tp (the built model's shards); under sequence parallelism, norms and the residual stream hold
tokens/tp rows. What context-parallel attention sends and holds for a moment: planning/context_parallel.py;
what a mixture-of-experts dispatcher sends: planning/experts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megalite.config import Config
from megalite.model import costs
from megalite.planning.built import micro_batch, moe_block, rank_model, token_rows

__all__ = ["Widths", "chunk_costs", "moe_block_bytes", "token_rows"]


@dataclass(frozen=True)
class Widths:
    """Bytes per element of the compute dtype and of the parameters' dtype, and the device kind whose kernels run."""

    compute: int
    residual: int
    device: str

    @classmethod
    def of(cls, cfg: Config, device: str) -> Widths:
        batch = micro_batch(cfg, device)
        return cls(batch.compute, batch.residual, batch.device)


def chunk_costs(cfg: Config, pp_rank: int, device: str,
                cost: Callable[[object, costs.MicroBatch], int]) -> list[int]:
    """For each model chunk of pipeline stage `pp_rank`: `cost` (model/costs.py saved_bytes, held_bytes, ...) of one
    micro batch summed over the modules its forward runs."""
    batch = micro_batch(cfg, device)
    return [sum(cost(module, batch) for module, _ in chunk) for chunk in rank_model(cfg, pp_rank).chunk_modules()]


def moe_block_bytes(cfg: Config, rows: int, w: Widths) -> int:
    """What the first mixture-of-experts block of the model keeps routing `rows` tokens of the rank's residual
    stream (a block on its own: tests/test_plan_experts.py)."""
    batch = costs.MicroBatch(token_rows(cfg)[0], rows, w.compute, w.residual, w.device)
    return costs.saved_bytes(moe_block(cfg), batch)
