"""The GPT model, written once for both families.

Activations flow as [seq, batch, hidden] (Megatron's order), which keeps the sequence
dimension first for sequence parallelism and pipeline hand-offs. The vocabulary is
padded for divisibility, but the head only scores the real vocabulary, so padded
entries take no probability mass and get no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.data.mtp_targets import MTPTargets
from megalite.model import costs
from megalite.model.attention import SelfAttention
from megalite.model.aux_losses import AuxLosses
from megalite.model.head import LMHead
from megalite.model.init import init_parameters
from megalite.model.kv_cache import KVCache, LayerCache
from megalite.model.latent_attention import LatentAttention
from megalite.model.mlp import MLP
from megalite.model.moe.experts import ExpertLinear
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.router import Router
from megalite.model.mtp import EHProjection, MultiTokenPrediction
from megalite.model.norms import build_norm
from megalite.model.rope import rope_for, rope_tables
from megalite.parallel.context import ParallelContext
from megalite.parallel.layers import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear, VocabParallelEmbedding
from megalite.parallel.lookup import Lookup
from megalite.parallel.mappings import local_rows
from megalite.parallel.pipeline.stage import StageLayout
from megalite.parallel.placement import Placement, parameter_placements
from megalite.parallel.random import checkpoint_with_rng

# With tied embeddings split over pipeline stages, the last stage holds its own copy of the first
# stage's word embeddings as its LM head: (the copy's name, the original's name).
TIED_COPY = ("lm_head.weight", "embedding.word_embeddings.weight")
# Untied, multi-token prediction's lookup holds that copy instead (model/mtp.py).
MTP_COPY = "mtp.word_embeddings.weight"


def embedding_copy(cfg: ModelConfig) -> str | None:
    """The name the head's stage gives its copy of the word embeddings when another stage holds them: the tied
    head's weight, else multi-token prediction's table; None when that stage reads no word embeddings."""
    if cfg.tied:
        return TIED_COPY[0]
    return MTP_COPY if cfg.mtp_num_layers else None


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, ctx: ParallelContext,
                 aux_losses: AuxLosses | None = None, index: int = 0) -> None:
        """`index`: the layer's global index (which layers have experts; multi-token prediction's depth d is
        num_layers + d)."""
        super().__init__()
        self.index = index
        norm = cfg.features.norm
        self.ctx, self.aux_losses = ctx, aux_losses or AuxLosses()  # the model's: terms the layer adds in forward
        self.input_norm = build_norm(norm, cfg.hidden_size, cfg.norm_epsilon, device)
        if cfg.multi_latent_attention:
            self.attention = LatentAttention(cfg, ctx, device)
        else:
            self.attention = SelfAttention(cfg, ctx, device, index)
        self.pre_mlp_norm = build_norm(norm, cfg.hidden_size, cfg.norm_epsilon, device)
        self.mlp = MoELayer(cfg, ctx, self.aux_losses, index) if cfg.has_experts(index) else MLP(cfg, ctx)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.recompute = False  # full recompute in training (set by model/recompute.py; the model's forward applies it)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        with self.ctx.hidden_rng():
            x = x + self.dropout(self.attention(self.input_norm(x), rope, cache))
            return x + self.dropout(self.mlp(self.pre_mlp_norm(x)))

    def saved_bytes(self, batch: costs.MicroBatch) -> int:
        """Under full recompute only the layer's input (the checkpoint's); else its parts' and the dropout masks
        after attention and MLP (one byte per element)."""
        hidden = self.input_norm.normalized_shape[-1]
        if self.recompute:
            return batch.rows * hidden * batch.residual
        dropout = 2 * batch.rows * hidden if self.dropout.p > 0 else 0
        return sum(costs.saved_bytes(part, batch) for part in self.children()) + dropout

    def recomputed_flops(self, seq: int) -> int:
        """Full recompute runs the layer's whole forward again; otherwise what its parts rerun."""
        if self.recompute:
            return costs.forward_flops(self, seq)
        return sum(costs.recomputed_flops(part, seq) for part in self.children())


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ctx)
        learned = cfg.features.position_embedding == "learned"
        self.position_embeddings = Lookup(cfg.positions, cfg.hidden_size) if learned else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.ctx = ctx

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """tokens, position_ids: [batch, seq] -> [seq (/tp under SP), batch, hidden]; positions default to 0..seq-1.
        Under sequence parallelism only this rank's slice of the positions is looked up (their table's gradient
        is then partial over tp, as its placement says)."""
        x = self.word_embeddings(tokens.t())
        if self.position_embeddings is not None:
            if position_ids is None:  # one row per position, broadcast over the batch
                ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(1)
            else:
                ids = position_ids.t()
            if self.ctx.sequence_parallel:
                ids = local_rows(ids, self.ctx.tp.group)
            x = x + self.position_embeddings(ids)
        with self.ctx.hidden_rng():
            return self.dropout(x)

    def saved_bytes(self, batch: costs.MicroBatch) -> int:
        """The token ids (int64), under tp the mask of ids outside this rank's rows, the dropout mask."""
        out_of_range = batch.tokens if self.ctx.tp.size > 1 else 0
        dropout = batch.rows * self.word_embeddings.weight.shape[1] if self.dropout.p > 0 else 0
        return batch.tokens * 8 + out_of_range + dropout

    def held_bytes(self, batch: costs.MicroBatch) -> int:
        """Each lookup's ids (int64) and output gradient (the parameters' dtype): the words', the positions'
        (this rank's rows of them under SP)."""
        hidden = self.word_embeddings.weight.shape[1]
        size = batch.tokens * (8 + hidden * batch.residual)
        return size + (batch.rows * (8 + hidden * batch.residual) if self.position_embeddings is not None else 0)


def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter (in `dtype`) and buffer of `module` uninitialised storage on `device`, as
    Module.to_empty does, but as new tensors (a parameter shared by two modules stays shared): to_empty swaps each
    parameter in place, which a fake-tensor mode refuses (the dry run builds real models on fake tensors:
    megalite/dryrun/)."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta tensor, kept alive: ids stay unique; new)
    for child in module.modules():
        for tensors, wrap in ((child._parameters, True), (child._buffers, False)):
            for key, tensor in tensors.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    if wrap:
                        empty = nn.Parameter(torch.empty_like(tensor, device=device, dtype=dtype), tensor.requires_grad)
                    else:
                        empty = torch.empty_like(tensor, device=device)
                    made[id(tensor)] = tensor, empty
                tensors[key] = made[id(tensor)][1]


class GPTModel(nn.Module):
    """One rank's part of the GPT: its tensor-parallel shards (`ctx`) of the layers of its pipeline
    chunks (`stage`), plus the embedding and/or head when it holds the first/last chunk.

    Layers keep their global index as name (`layers.17...`), so every layout has the one-device
    parameter names. Under context parallelism it runs on this rank's part of each sequence,
    with explicit position ids. With tied embeddings split over pipeline stages, the last stage holds a copy
    of the word embeddings as `lm_head.weight` (TIED_COPY), initialised identically and kept equal
    by all-reducing its gradient with the first stage's (parallel/ddp.py).

    The constructor reads only the architecture (`cfg`), the init `seed` and the parameters' `dtype`; how the model is
    trained (activation recompute: model/recompute.py; the split backward: model/split_backward.py) is applied to it
    afterwards.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, ctx: ParallelContext | None = None,
                 stage: StageLayout | None = None, *, seed: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.ctx = cfg, cfg.vocab, ctx or ParallelContext()
        self.stage = stage or StageLayout.single(cfg.num_layers)
        self.aux_losses = AuxLosses()  # terms layers add in forward (model/aux_losses.py)
        with torch.device("meta"):
            self._build_modules(cfg, device)
        materialize(self, device, dtype)
        if device.type != "meta":  # a meta build is for shapes and counts (planner, tests): nothing to draw
            init_parameters(self, seed, cfg, self.placements_by_name(), self.ctx.coord, self.tied_copies())
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _build_modules(self, cfg: ModelConfig, device: torch.device) -> None:
        """The embedding, layers, final norm and LM head this stage holds (the first/last chunk's parts only there)."""
        stage, ctx = self.stage, self.ctx
        self.embedding = Embedding(cfg, ctx) if stage.has_embedding else None
        indices = [i for a, b in stage.chunks for i in range(a, b)]
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, device, ctx, self.aux_losses, i)
                                     for i in indices})
        self.final_norm = self.lm_head = None
        if stage.has_head:
            self.final_norm = build_norm(cfg.features.norm, cfg.hidden_size, cfg.norm_epsilon, device)
            own_weight = not (cfg.tied and stage.shares_embedding)
            self.lm_head = LMHead(cfg.hidden_size, cfg.padded_vocab_size, cfg.vocab, ctx, own_weight)
        self.mtp = None
        if stage.has_head and cfg.mtp_num_layers:
            layers = [TransformerLayer(cfg, device, ctx, self.aux_losses, cfg.num_layers + d)
                      for d in range(cfg.mtp_num_layers)]
            self.mtp = MultiTokenPrediction(cfg, ctx, device, layers, self.aux_losses,
                                            MTP_COPY in self.tied_copies(), self.lm_head)

    def transformer_layers(self) -> list[TransformerLayer]:
        """This rank's transformer layers: its chunks', then multi-token prediction's."""
        depths = [] if self.mtp is None else [depth.transformer_layer for depth in self.mtp.layers]
        return [*self.layers.values(), *depths]

    def placements_by_name(self) -> dict[str, Placement]:
        """Where each of this rank's parameters lives (parallel/placement.py), by local name."""
        return parameter_placements(self, self.ctx.sequence_parallel, self.tied_copies())

    def hidden_matrices(self, routers: bool) -> set[str]:
        """The layers' weight matrices (Muon's; the embedding, head, norms and biases are not among them): every
        linear layer's and expert projection's weight, latent attention's down-projections and multi-token
        prediction's layers and projections included, and with `routers` the MoE routers' and shared-expert
        gates' too (Moonlight's choice)."""
        linear = (ColumnParallelLinear, RowParallelLinear, DuplicatedLinear, ExpertLinear, EHProjection)
        linear += (Router,) if routers else ()
        owners = [("layers", self.layers)] + ([] if self.mtp is None else [("mtp.layers", self.mtp.layers)])
        names = {f"{prefix}.{name}.weight" for prefix, modules in owners
                 for name, module in modules.named_modules() if isinstance(module, linear)}
        if routers:
            names |= {f"{prefix}.{name}" for prefix, modules in owners for name, _ in modules.named_parameters()
                      if name.endswith("shared_expert_gate")}
        return names

    def tied_copies(self) -> dict[str, str]:
        """{copy name: original name} of the word embeddings' copy this stage holds (`embedding_copy`): on the
        head's stage of a pipeline, when embeddings are tied or multi-token prediction looks them up; else empty."""
        copy = embedding_copy(self.cfg)
        holds_copy = copy is not None and self.stage.has_head and not self.stage.shares_embedding
        return {copy: TIED_COPY[1]} if holds_copy else {}

    def _word_embeddings(self) -> torch.Tensor | None:
        """The word embeddings on this stage when they are not its own `embedding`'s: the tied head's copy."""
        if self.embedding is not None and self.stage.shares_embedding:
            return self.embedding.word_embeddings.weight
        return self.lm_head.weight if self.cfg.tied else None

    def chunk_parameters(self) -> list[list[nn.Parameter]]:
        """Parameters grouped by the model chunk whose backward produces their gradients."""
        groups = [[p for i in range(a, b) for p in self.layers[str(i)].parameters()] for a, b in self.stage.chunks]
        if self.embedding is not None:
            groups[0] = list(self.embedding.parameters()) + groups[0]
        if self.stage.has_head:
            groups[-1] = groups[-1] + [*self.final_norm.parameters(), *self.lm_head.parameters()]
        if self.mtp is not None:
            groups[-1] = groups[-1] + list(self.mtp.parameters())
        return groups

    def chunk_modules(self) -> list[list[tuple[nn.Module, list[nn.Parameter]]]]:
        """Per model chunk, the modules its forward runs, in order, each with the parameters its forward
        reads (the LM head of tied embeddings on this stage reads the word embeddings): ZeRO-3's gather units."""
        chunks = [[(self.layers[str(i)], list(self.layers[str(i)].parameters())) for i in range(a, b)]
                  for a, b in self.stage.chunks]
        if self.embedding is not None:
            chunks[0].insert(0, (self.embedding, list(self.embedding.parameters())))
        if self.stage.has_head:
            head = [self.lm_head.weight if self.lm_head.weight is not None else self.embedding.word_embeddings.weight]
            chunks[-1] += [(self.final_norm, list(self.final_norm.parameters())), (self.lm_head, head)]
        if self.mtp is not None:  # one unit, after the head: per depth a lookup of the tokens ahead and the head
            lookup, depths = self.mtp.word_embeddings, len(self.mtp.layers)
            table = lookup.weight if lookup.weight is not None else self._word_embeddings()
            own = [p for p in self.mtp.parameters() if p is not table]
            chunks[-1] += [(self.mtp, [*own, *[table] * depths, *head * depths])]
        return chunks

    def _rope(self, tokens: torch.Tensor,
              position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.cfg.features.position_embedding != "rope":
            return None
        if tokens.device not in self._rope_cache:
            self._rope_cache[tokens.device] = rope_tables(self.cfg, tokens.device)
        return rope_for(self._rope_cache[tokens.device], tokens.shape[1], position_ids)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None, chunk: int = 0,
                cache: KVCache | None = None, mtp: MTPTargets | None = None) -> torch.Tensor:
        """Run model chunk `chunk` of this rank on one micro batch.

        The first chunk embeds `tokens`; others continue from `hidden` ([seq (/tp under SP), batch,
        hidden], what the previous chunk returned). The last chunk returns per-token losses
        [batch, seq] in fp32 when labels are given, else logits [batch, seq, vocab]; others return
        their hidden states. position_ids [batch, seq] restart positions inside a sample.
        With a KV cache (generation) `tokens` continue the cached ones: positions start at
        cache.length unless given, and the layers store the tokens' keys and values. With multi-token
        prediction's targets (`mtp`, training) the returned losses carry its losses into backward (model/mtp.py).
        """
        if cache is not None and position_ids is None:
            position_ids = torch.arange(cache.length, cache.length + tokens.shape[1],
                                        device=tokens.device).expand(tokens.shape[0], -1)
        x = self.embedding(tokens, position_ids) if self.stage.is_first_chunk(chunk) else hidden
        rope = self._rope(tokens, position_ids)
        for index in range(*self.stage.chunks[chunk]):
            layer = self.layers[str(index)]
            if layer.recompute and self.training:
                x = checkpoint_with_rng(layer, x, rope, tracker=self.ctx.rng, replay=self.aux_losses.replaying)
            else:
                x = layer(x, rope, None if cache is None else cache[index])
        if not self.stage.is_last_chunk(chunk):
            return x
        tied = self.embedding.word_embeddings.weight if self.lm_head.weight is None else None
        x = self.final_norm(x)
        out = self.lm_head(x, labels, tied)
        if mtp is None or labels is None or self.mtp is None:
            return out
        return self.mtp(x, out, mtp, rope, self._word_embeddings(), tied)
