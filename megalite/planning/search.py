"""The layout search: every tp, cp, pp, vp, schedule, ep, etp, ZeRO stage, recompute and micro batch size the validator
accepts for a model, a global batch and a cluster, ranked by predicted step time (planning/step_time.py) among
those that fit with the planner's reserve (planning/plan.py).

Fast by pruning, not by a second planner:
1. candidates are the grid of choices, each one validated (megalite/config_validation.py: every candidate is a
   config pretrain_gpt.py accepts); tp stays within a node (its collectives are not overlapped), etp is 1 or tp,
   vp a power of two, and cp keeps at least MIN_CP_TOKENS tokens of a sample per rank;
2. a candidate whose estimated memory leaves no room is dropped unplanned: its model state (each rank's parameters:
   the one-device model's layers, embedding and head divided as its layout divides them, at its ZeRO stage:
   planning/memory.py state_bytes) and the activations of the micro batches in flight (`estimated_gib`);
3. the rest are timed (arithmetic only, on the same per-stage parameter counts) and sorted;
4. the fastest are planned exactly (planning/plan.py, the meta builds cached per model shape: planning/built.py),
   in order, until `top` fit.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from megalite.config import Config, ConfigError, ModelConfig
from megalite.config_validation import validate
from megalite.model import costs
from megalite.parallel.pipeline.registry import SCHEDULES, stage_layout, training_schedules
from megalite.planning.built import first_layer, micro_batch, one_device_model, section_values
from megalite.planning.cluster import Cluster
from megalite.planning.memory import grid_replicas, state_bytes
from megalite.planning.plan import GPUS, RESERVED_GIB, Plan, make_plan
from megalite.planning.step_time import StepTime, step_time

GIB = 2**30
MIN_CP_TOKENS = 4096  # tokens of a sample per context-parallel rank: below, the ring's hops outrun its blocks
INTERLEAVED = "1f1b"  # the schedule tried at vp > 1 (the others run one chunk per rank, or their spec's vp)
VIRTUAL_STAGES = (1, 2, 4, 8)  # its vp
ZERO_STAGES = (1, 2, 3)  # stage 0 moves what stage 1 moves (an all-reduce is a reduce-scatter and an all-gather)
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4)
MAX_PLANNED = 60  # exact plans tried before giving up on finding `top` that fit


@dataclass(frozen=True)
class Candidate:
    cfg: Config
    time: StepTime
    plan: Plan | None = None  # the exact plan, once made

    @property
    def layout(self) -> str:
        return describe(self.cfg, self.time.microbatches)


@dataclass(frozen=True)
class SearchResult:
    ranked: list[Candidate]  # fitting, fastest first
    considered: int  # candidates the validator accepted
    pruned: int  # dropped on their estimated memory
    planned: int  # exact plans made


def describe(cfg: Config, microbatches: int) -> str:
    """A layout in a line: its axes, schedule, ZeRO stage, recompute and micro batch."""
    p, t = cfg.parallel, cfg.train
    ep = f" ep{p.ep}" + (f" etp{p.etp}" if p.etp > 1 else "") if p.ep > 1 else ""
    pipe = f" pp{p.pp}" + (f" vp{p.vp}" if p.vp > 1 else "") + (f" {p.pipeline_schedule}" if p.pp > 1 else "")
    return (f"tp{p.tp} cp{p.cp}{pipe}{ep} zero{p.zero} recompute {t.recompute} mbs {t.micro_batch_size} "
            f"({microbatches} micro batches)")


def layouts(cfg: Config, cluster: Cluster) -> Iterator[dict]:
    """The parallel fields of every layout shape worth trying (validation comes after)."""
    m, world = cfg.model, cluster.world_size
    tps = [t for t in _powers(cluster.gpus_per_node) if world % t == 0]
    cps = [c for c in _powers(world) if m.seq_length // c >= MIN_CP_TOKENS or c == 1]
    eps = [e for e in range(1, m.num_experts + 1) if m.num_experts % e == 0] if m.num_experts else [1]
    for tp, cp, ep in itertools.product(tps, cps, eps):
        pps = [d for d in range(1, min(world // (tp * cp), m.num_layers) + 1) if (world // (tp * cp)) % d == 0]
        for etp, pp in itertools.product(_expert_tp(cfg, tp), pps):
            for schedule, vp in _schedules(pp):
                ends = _end_layers(m.num_layers, pp * vp)
                if ends is not None:
                    yield {"tp": tp, "cp": cp, "ep": ep, "etp": etp, "pp": pp, "vp": vp,
                           "pipeline_schedule": schedule, "sequence_parallel": tp > 1,
                           "first_stage_layers": ends[0], "last_stage_layers": ends[1]}


def _expert_tp(cfg: Config, tp: int) -> list[int]:
    """etp sizes: 1 (whole experts: DeepSeek-V3, torchtitan's default) or tp (Megatron-Core's default), where it
    divides the experts' width."""
    m = cfg.model
    return sorted({1, tp}) if m.num_experts and m.expert_ffn_size % tp == 0 else [1]


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _end_layers(layers: int, chunks: int) -> tuple[int | None, int | None] | None:
    """Layers of the first and the last chunk: (None, None) for an even split; else the middle chunks take
    ceil(layers / chunks) each and the ends share the rest, the first (the embedding's, lighter than the head's)
    the larger half: Llama 3 405B's 126 = 1 + 62 x 2 + 1 at pp 16 x vp 4, DeepSeek-V3's 61 = 3 + 14 x 4 + 2 at
    pp 16. None when an end would be left empty."""
    if layers % chunks == 0:
        return None, None
    share = -(-layers // chunks)
    rest = layers - (chunks - 2) * share
    return (rest - rest // 2, rest // 2) if chunks > 2 and rest >= 2 else None


def _schedules(pp: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    for name in training_schedules():
        fixed = SCHEDULES[name].vp
        vps = [fixed] if fixed else VIRTUAL_STAGES if name == INTERLEAVED else [1]
        yield from ((name, vp) for vp in vps)


def variants(cfg: Config, parallel: dict) -> Iterator[Config]:
    """`cfg` under the layout `parallel` with every ZeRO stage, recompute and micro batch size."""
    base = dataclasses.replace(cfg.parallel, **parallel)
    for zero, recompute, mbs in itertools.product(ZERO_STAGES, RECOMPUTE, MICRO_BATCHES):
        staged = dataclasses.replace(base, zero_stage=zero, distributed_optimizer=False)
        yield dataclasses.replace(cfg, parallel=staged,
                                  train=dataclasses.replace(cfg.train, recompute=recompute, micro_batch_size=mbs))


def _valid(cfg: Config, world_size: int) -> bool:
    try:
        validate(cfg, world_size)
    except ConfigError:
        return False
    return True


@functools.lru_cache(maxsize=8)
def _part_sizes(model: tuple) -> tuple[int, int, int, int]:
    """(dense and expert elements of a layer, averaged over the layers; embedding; final norm and LM head) of the
    one-device model of ModelConfig(*model)."""
    built = one_device_model(ModelConfig(*model))
    placements = built.placements_by_name()
    dense = expert = 0
    for name, param in built.layers.named_parameters(prefix="layers"):
        if placements[name].grid == "expert":
            expert += param.numel()
        else:
            dense += param.numel()
    layers = len(built.layers)
    head = sum(p.numel() for p in built.final_norm.parameters())
    head += built.lm_head.weight.numel() if built.lm_head.weight is not None else 0
    return dense // layers, expert // layers, built.embedding.word_embeddings.weight.numel(), head


def stage_buffers(cfg: Config, pp_rank: int) -> dict[str, list[int]]:
    """Elements of each gradient buffer of stage `pp_rank`, from the one-device model's parts divided by the
    layout (norms counted as split too, padding left out: a lower bound, within a percent)."""
    p, m = cfg.parallel, cfg.model
    dense, expert, embedding, head = _part_sizes(section_values(m))
    layout = stage_layout(cfg, pp_rank)
    buffers: dict[str, list[int]] = {"dense": [], "expert": []}
    for index, (a, b) in enumerate(layout.chunks):
        g = layout.global_chunk(index)
        ends = (embedding if g == 0 else 0) + (head if g == layout.model_chunks - 1 else 0)
        ends += embedding if m.tied and p.pp > 1 and g == layout.model_chunks - 1 else 0
        buffers["dense"].append(((b - a) * dense + ends) // p.tp)
        if expert:
            buffers["expert"].append((b - a) * expert // (p.ep * p.etp))
    return buffers


def estimated_gib(cfg: Config, world_size: int, buffers: list[dict[str, list[int]]]) -> float:
    """The largest stage's model state (weights, gradients, main weights, optimizer: the first stage may hold
    dense layers where the others hold experts) and the activations of the micro batches a 1F1B-like schedule
    keeps on the first stage (min(m, pp) of its whole stage: planning/memory.py plays the schedule's op lists out
    instead), from one layer's declaration (model/costs.py), in GiB: a quick estimate that only decides which
    candidates are planned exactly."""
    replicas, p = grid_replicas(cfg, world_size), cfg.parallel
    state = max(sum(sum(state_bytes(cfg, sum(sizes), replicas[grid])) for grid, sizes in stage.items())
                for stage in buffers)
    layers = sum(b - a for a, b in stage_layout(cfg, 0).chunks)
    in_flight = min(cfg.num_microbatches(world_size), p.pp)
    activations = in_flight * layers * costs.saved_bytes(first_layer(cfg), micro_batch(cfg))
    return (state + activations) / GIB


def candidates(cfg: Config, cluster: Cluster, mfu: float) -> tuple[list[Candidate], int, int]:
    """(the timed candidates, fastest first; how many the validator accepted; how many were pruned on estimated
    memory)."""
    world, room = cluster.world_size, GPUS[cluster.gpu][0] / 1024 - RESERVED_GIB
    timed, considered, pruned = [], 0, 0
    for parallel in layouts(cfg, cluster):
        shaped = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))
        if not _valid(shaped, world):
            continue
        buffers = [stage_buffers(shaped, r) for r in range(shaped.parallel.pp)]
        for variant in variants(cfg, parallel):
            if not _valid(variant, world):
                continue
            considered += 1
            if estimated_gib(variant, world, buffers) >= room:
                pruned += 1
                continue
            timed.append(Candidate(variant, step_time(variant, world, cluster, mfu, buffers)))
    timed.sort(key=lambda c: c.time.seconds)
    return timed, considered, pruned


def with_data(cfg: Config) -> Config:
    """`cfg`, with synthetic tokens where it names no corpus (a model from a Hugging Face config): the layout does
    not depend on the data, and the validator asks for some."""
    d = cfg.data
    if d.mock or d.paths or d.train_paths:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(d, mock=True))


def search(cfg: Config, cluster: Cluster, mfu: float, top: int = 5) -> SearchResult:
    """The `top` fastest layouts of `cfg`'s model and global batch that fit on `cluster` (module docstring)."""
    if cfg.train.global_batch_size is None:
        raise ConfigError("train.global_batch_size is not set: the search keeps the tokens per step fixed; set "
                          "--train.global_batch_size=N (samples per step)")
    cfg = with_data(cfg)
    timed, considered, pruned = candidates(cfg, cluster, mfu)
    ranked, planned = [], 0
    for candidate in timed[:MAX_PLANNED]:
        plan = make_plan(candidate.cfg, cluster.world_size, cluster.gpu, mfu)
        planned += 1
        if plan.fits:
            ranked.append(dataclasses.replace(candidate, plan=plan))
            if len(ranked) == top:
                break
    return SearchResult(ranked, considered, pruned, planned)
