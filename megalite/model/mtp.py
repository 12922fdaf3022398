"""Multi-token prediction (DeepSeek-V3's report, section 2.2; Megatron-Core's MultiTokenPredictionBlock).

Depth k (1..D) at position i: h'_k = W_eh [norm(Emb(t_{i+k})); norm(h_{k-1})] (the embedding first, as the
released `eh_proj` weights are laid out), h_k = one transformer layer of the model's kind (experts where layer
num_layers + k - 1 would have them: DeepSeek-V3's layer 61), then its own final norm; the shared output head
scores h_k against t_{i+k+1}. h_0 is the main model's output after its final norm, and each depth hands on its
normed output, as Megatron-Core and the inference engines serving DeepSeek-V3's MTP layer take them.

The block runs on the stage holding the output head, after it; the word embeddings it looks up are the model's
own there, else the tied head's copy of them, else a copy of its own (`word_embeddings.weight`), kept equal to
the first stage's as the tied head's is (GPTModel.tied_copies). Each depth's summed masked token losses join
backward through the model's auxiliary-loss path (model/aux_losses.py), attached to the main per-token losses:
(mtp_loss_scaling_factor / D) times the sum over the main loss's token count, which is the DeepSeek-V3 report's
L_MTP^k = -(1/T) sum_i log P_i^k (its T counts the main predictions) and Megatron-Core's per-token loss. The sums
are counted per depth (`mtp_1`, ...) for logging.

The lookup of the tokens ahead is the word embeddings alone (no position table, no dropout: DeepSeek-V3's
Emb(t_{i+k})); the layer drops out as the model's layers do. eh_proj is whole on every tensor-parallel rank (its
placement the default: partial over tp under sequence parallelism), so it runs on the rank's own rows with no
communication; the transformer layer and the head are the model's parallel layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.data.mtp_targets import MTPTargets
from megalite.model import costs
from megalite.model.aux_losses import AuxLosses
from megalite.model.head import LMHead
from megalite.model.norms import build_norm
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.layers import VocabParallelEmbedding
from megalite.parallel.mappings import in_compute_dtype
from megalite.parallel.random import checkpoint_with_rng


class EHProjection(nn.Module):
    """[embedding; hidden] (2 x hidden) -> hidden, no bias; the weight whole on every tensor-parallel rank."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, 2 * hidden_size))
        self.recipe = gemm.HIGH_PRECISION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(in_compute_dtype(x), self.weight, recipe=self.recipe)

    def saved_bytes(self, batch: costs.MicroBatch) -> int:
        return batch.rows * self.weight.shape[1] * batch.compute

    def held_bytes(self, batch: costs.MicroBatch) -> int:
        return costs.matmul_held(self.weight, batch.rows, batch.compute)

    def matmul_parameters(self) -> int:
        return self.weight.numel()


class MTPDepth(nn.Module):
    """One depth: the two norms, the projection, `transformer_layer` (built by the model: its layer kind) and the
    final norm."""

    def __init__(self, cfg: ModelConfig, device: torch.device, transformer_layer: nn.Module) -> None:
        super().__init__()
        norm, hidden = cfg.features.norm, cfg.hidden_size
        self.enorm = build_norm(norm, hidden, cfg.norm_epsilon, device)
        self.hnorm = build_norm(norm, hidden, cfg.norm_epsilon, device)
        self.eh_proj = EHProjection(hidden)
        self.transformer_layer = transformer_layer
        self.final_norm = build_norm(norm, hidden, cfg.norm_epsilon, device)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """hidden, embedded [seq (/tp under SP), batch, hidden] -> this depth's normed output, same shape."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        layer = self.transformer_layer
        if layer.recompute and self.training:
            x = checkpoint_with_rng(layer, x, rope, tracker=layer.ctx.rng, replay=layer.aux_losses.replaying)
        else:
            x = layer(x, rope)
        return self.final_norm(x)


class MultiTokenPrediction(nn.Module):
    """The D depths, and the lookup of the tokens ahead (in its own copy of the word embeddings when
    `owns_embedding`, else in the table its forward is handed); `head`, the model's LM head, is shared, not held
    (its parameters stay the model's): each depth runs it once more, which its costs count."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, device: torch.device, layers: list[nn.Module],
                 aux_losses: AuxLosses, owns_embedding: bool, head: LMHead) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ctx, owns_embedding)
        self.layers = nn.ModuleList([MTPDepth(cfg, device, layer) for layer in layers])
        self.aux_losses, self.scale = aux_losses, cfg.mtp_loss_scaling_factor / len(layers)
        self._head = (head,)  # in a tuple: not a submodule

    def forward(self, hidden: torch.Tensor, losses: torch.Tensor, targets: MTPTargets,
                rope: tuple[torch.Tensor, torch.Tensor] | None, table: torch.Tensor | None,
                tied: torch.Tensor | None) -> torch.Tensor:
        """From the main model's normed output `hidden` and per-token `losses` [batch, seq]: the losses, carrying
        every depth's loss into backward. `table`: the word embeddings when this block holds no copy; `tied`: the
        head's weight when the head owns none."""
        head = self._head[0]
        for k, depth in enumerate(self.layers):
            hidden = depth(hidden, self.word_embeddings(targets.tokens[k].t(), table), rope)
            mask = targets.loss_mask[k]
            total = (head(hidden, targets.labels[k], tied) * mask).sum()
            losses = self.aux_losses.attach(f"mtp_{k + 1}", losses, total, weight=self.scale / mask.numel())
        return losses

    def _with_heads(self, cost: Callable[..., int], *args: object) -> int:
        """A cost of the depths plus one more run of the shared head per depth."""
        return cost(self.layers, *args) + len(self.layers) * cost(self._head[0], *args)

    def saved_bytes(self, batch: costs.MicroBatch) -> int:
        return self._with_heads(costs.saved_bytes, batch)

    def held_bytes(self, batch: costs.MicroBatch) -> int:
        return self._with_heads(costs.held_bytes, batch)

    def transient_bytes(self, batch: costs.MicroBatch) -> int:
        return self._with_heads(costs.transient_bytes, batch)

    def matmul_parameters(self) -> int:
        return self._with_heads(costs.matmul_parameters)
