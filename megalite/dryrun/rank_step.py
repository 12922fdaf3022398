"""Simulate one rank: the real build_trainer and one real train_step on fake tensors under the fake group.

Everything a rank does runs: its groups are built at the full world size, its model chunks, gradient buffers,
distributed optimizer and pipeline are built, and one step runs its whole schedule (every micro batch's forward
and backward, the gradient reduction, clipping and the update). What it cannot do is read a value: nothing in
a bf16 or fp32 step does (training/step.py), but the dropless all-to-all reads its split sizes, which balanced
routing stands in for (model/moe/layer.py assume_balanced_routing).

Memory is counted as an allocator sees it (live_bytes.py). One step is the first step, in which Adam creates its
moments inside the update: in every later step they are alive throughout, so the steady-state peak is the larger
of the forward/backward peak plus the optimizer state and the update's own peak.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megalite.config import Config
from megalite.data.batches import Batch
from megalite.dryrun.fake_world import as_accelerator, fake_rank, fake_tensors
from megalite.dryrun.live_bytes import LiveBytes
from megalite.dryrun.nccl_rules.record import Call, CommRecorder
from megalite.dryrun.roles import Role
from megalite.model import init
from megalite.model.moe.layer import assume_balanced_routing
from megalite.parallel.topology import Topology
from megalite.planning.measure import kept_gradients
from megalite.training.build import Trainer, build_trainer
from megalite.training.step import train_step


@dataclass
class RankRun:
    """What one simulated rank held and did in its step."""

    role: Role
    coords: dict[str, int]
    memory: dict[str, int]  # device bytes by kind at the steady-state peak (live_bytes.KINDS)
    host: int  # offloaded bytes (optim.offload=cpu: main weights, optimizer state, gradient copies)
    build: tuple[int, int]  # the most device bytes while building, and the most host memory the init drew at once
    calls: list[Call] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # groups, build, step
    largest: list[tuple[int, str, str]] = field(default_factory=list)  # (bytes, kind, made at) at the peak

    @property
    def total(self) -> int:
        return sum(self.memory.values())


def fake_batches(cfg: Config, count: int) -> list[Batch]:
    """`count` micro batches shaped as the loader makes them (position ids where documents restart them)."""
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length)
    positions = torch.zeros(shape, dtype=torch.long) if cfg.data.reset_position_ids else None
    return [Batch(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long),
                  torch.ones(shape), positions) for _ in range(count)]


def label_state(live: LiveBytes, trainer: Trainer) -> None:
    """Name the storages of the model state: parameters (and ZeRO-3's owned slices), gradient buffers, main
    weights that are not the parameters themselves, and, offloaded, what lives on the host."""
    strategies = [buffer.strategy for buffer in trainer.grads.buffers]
    live.label([*trainer.model.parameters(), *(s.param_shard for s in strategies)], "weights")
    live.label(kept_gradients(trainer.grads.buffers), "gradients")
    offloaded = trainer.cfg.optim.offload == "cpu"
    mains = [m.main for m in trainer.optimizer.shards() if live.kind_of(m.main) != "weights"]
    live.label(mains, "host" if offloaded else "main_weights")
    live.label(trainer.optimizer.host_grads(), "host")


Phase = tuple[dict[str, int], list]  # a phase's peak: bytes by kind, and its largest storages (LiveBytes sites)


@contextlib.contextmanager
def update_phase(trainer: Trainer, live: LiveBytes) -> Iterator[dict[str, Phase]]:
    """Split the step's peak at the optimizer's update: {"backward": the peak before it, "update": during and
    after it}; what the update makes counts as optimizer state (host, offloaded). torch's optimizer hooks
    mark the update's start and end."""
    optimizer, phases = trainer.optimizer.optimizer, {}
    kind = "host" if trainer.cfg.optim.offload == "cpu" else "optimizer"
    with contextlib.ExitStack() as hooks, contextlib.ExitStack() as updating:

        def before(*_args) -> None:
            phases["backward"] = dict(live.at_peak), live.largest_at_peak
            live.reset_peak()
            updating.enter_context(live.making(kind))

        hooks.callback(optimizer.register_step_pre_hook(before).remove)
        hooks.callback(optimizer.register_step_post_hook(lambda *_args: updating.close()).remove)
        yield phases
        phases["update"] = dict(live.at_peak), live.largest_at_peak


def steady_peak(phases: dict[str, Phase], state: int) -> Phase:
    """The larger peak once Adam's state (`state` bytes, made in the first update) exists from the step's start."""
    kinds, largest = phases.get("backward", ({}, []))
    before = {**kinds, "optimizer": kinds.get("optimizer", 0) + state}, largest
    return max(before, phases["update"], key=lambda phase: sum(v for k, v in phase[0].items() if k != "host"))


def simulate_rank(cfg: Config, world_size: int, role: Role, microbatches: int, sites: int = 0) -> RankRun:
    """Build `role`'s rank of `cfg` at `world_size` ranks and run one step of `microbatches` micro batches;
    `sites`: keep that many of the largest storages alive at the peak, with the code that made them."""
    seconds = {}
    with fake_rank(role.rank, world_size):
        start = time.perf_counter()
        topology = Topology.from_config(role.rank, world_size, torch.device("cpu"), cfg.parallel,
                                        cfg.model.num_experts > 0)
        seconds["groups"] = time.perf_counter() - start
        live = LiveBytes(sites)
        with fake_tensors(live):
            start = time.perf_counter()
            with init.draws_inside(lambda: live.making("host")):
                trainer = build_trainer(cfg, topology)
            as_accelerator(trainer.model)
            assume_balanced_routing(trainer.model)
            label_state(live, trainer)
            build = live.peak, live.host_peak
            live.reset_peak()
            seconds["build"] = time.perf_counter() - start
            batches = fake_batches(cfg, microbatches)
            start = time.perf_counter()
            with CommRecorder(role.rank) as recorder, update_phase(trainer, live) as phases, trainer:
                train_step(trainer, batches)
            seconds["step"] = time.perf_counter() - start
            state = live.totals["optimizer"]
            memory, largest = steady_peak(phases, state)
            host = live.totals["host"]  # offloaded state (the init's draws are gone)
            del trainer, batches
    coords = topology.grid.coords(role.rank)
    device = {kind: memory.get(kind, 0) for kind in memory if kind != "host"}
    return RankRun(role, coords, device, host, build, recorder.record.calls, seconds, largest)
