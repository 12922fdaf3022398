"""Parameter counts per rank of each pipeline stage, read from the model built on the meta device (planning/built.py).

What one tensor- and expert-parallel rank of a stage holds is its model's parameters, each on the rank grid its
placement names (parallel/placement.py): dense ones (split over tp or replicated) and the experts' (the expert grid:
num_experts/ep of them per rank). The counts keep the two grids apart (`Parameters.by_grid`), as gradients are
reduced and optimizer state sharded over each grid's own data axes (planning/memory.py). With tied embeddings
under pipeline parallelism the last stage holds its own copy of the word embeddings as the LM head, which costs
memory there. Each count also lists its ZeRO-3 gather units (GPTModel.chunk_modules: the embedding, each layer,
the final norm and an untied LM head), each gathered whole around its use (parallel/zero/stage3.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import Config, ModelConfig
from megalite.model import costs
from megalite.parallel.fp8.param_gather import gathered_weights
from megalite.parallel.zero import unit_index
from megalite.planning.built import one_device_model, rank_model


@dataclass(frozen=True)
class Parameters:
    """Element counts held by one rank, on each rank grid."""

    dense: int = 0
    expert: int = 0  # on the expert grid: this rank's experts' weights (num_experts/ep experts of each layer)
    largest: int = 0  # elements of the largest single parameter (its gradient is briefly materialised)
    units: tuple[int, ...] = ()  # elements of each gather unit with parameters of its own, in forward order
    tied_head: bool = False  # a later unit (a tied LM head, multi-token prediction) reads the word embeddings of
    # this rank's embedding unit (units[0])
    muon: tuple[int, int] = (0, 0)  # (dense, expert) elements Muon steps (optim.optimizer=muon): one moment each
    fp8: tuple[int, int] = (0, 0)  # (dense, expert) elements gathered in FP8 (train.fp8_param_gather): a copy each
    fp8_units: tuple[int, ...] = ()  # those elements in each of `units`

    @property
    def total(self) -> int:
        return self.dense + self.expert

    @property
    def by_grid(self) -> dict[str, int]:
        """Elements on each rank grid (parallel/placement.py `Placement.grid`)."""
        return {"dense": self.dense, "expert": self.expert}

    @property
    def muon_by_grid(self) -> dict[str, int]:
        return dict(zip(("dense", "expert"), self.muon))

    @property
    def fp8_by_grid(self) -> dict[str, int]:
        return dict(zip(("dense", "expert"), self.fp8))


def rank_parameters(cfg: Config, pp_rank: int) -> Parameters:
    """What one tensor- and expert-parallel rank of pipeline stage `pp_rank` holds (same for every such rank)."""
    model = rank_model(cfg, pp_rank)
    placements, grids, muon = model.placements_by_name(), {"dense": 0, "expert": 0}, {"dense": 0, "expert": 0}
    matrices = model.hidden_matrices(cfg.optim.muon_routers) if cfg.optim.optimizer == "muon" else set()
    for name, param in model.named_parameters():
        grids[placements[name].grid] += param.numel()
        muon[placements[name].grid] += param.numel() if name in matrices else 0
    index = unit_index(model.chunk_modules())
    fp8 = gathered_weights(model) if cfg.train.fp8_param_gather else {}
    units: dict[int, int] = {}
    fp8_units, fp8_grids = dict.fromkeys(index.values(), 0), {"dense": 0, "expert": 0}
    for name, param in model.named_parameters():
        units[index[id(param)]] = units.get(index[id(param)], 0) + param.numel()
        fp8_units[index[id(param)]] += param.numel() if id(param) in fp8 else 0
        fp8_grids[placements[name].grid] += param.numel() if id(param) in fp8 else 0
    table = model.embedding.word_embeddings.weight if model.embedding is not None else None
    read_later = any(p is table for chunk in model.chunk_modules() for module, params in chunk
                     if module is not model.embedding for p in params)
    return Parameters(grids["dense"], grids["expert"], max(p.numel() for p in model.parameters()),
                      tuple(units[unit] for unit in sorted(units)), read_later, (muon["dense"], muon["expert"]),
                      (fp8_grids["dense"], fp8_grids["expert"]), tuple(fp8_units[unit] for unit in sorted(units)))


def model_parameters(m: ModelConfig) -> int:
    """The one-device model's parameter count (padded vocabulary; a tied head counted once)."""
    return sum(p.numel() for p in one_device_model(m).parameters())


def layer_parameters(m: ModelConfig) -> int:
    """The parameters of the one-device model's transformer layers."""
    return sum(p.numel() for p in one_device_model(m).layers.parameters())


def active_parameters(m: ModelConfig) -> int:
    """The parameters one token uses: the model less, in each mixture-of-experts layer, the experts it is not
    routed to; the dense parts, router and shared expert all count (model/costs.py)."""
    return costs.active_parameters(one_device_model(m))


def moe_layers(m: ModelConfig) -> int:
    """How many layers have routed experts."""
    return len(m.moe_layers)


def vocabulary_padding(m: ModelConfig) -> int:
    """Parameters added by padding the vocabulary (twice when the head is untied)."""
    return (m.padded_vocab_size - m.vocab) * m.hidden_size * (1 if m.tied else 2)
