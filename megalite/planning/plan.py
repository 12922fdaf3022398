"""A whole plan for one config and world size: parameters, memory per GPU with a verdict, pipeline
bubble, FLOPs and the step time an assumed MFU gives. `tools/plan.py` prints it. With mixture-of-experts
layers it also gives the parameters one token uses (what the FLOPs count), the experts' share of each
GPU's model state and what the token dispatch sends (planning/experts.py). With pipeline parallelism it
weighs every schedule the layout allows (ZB-V and DualPipeV at vp 2) by its bubble and memory, each with its
verdict.

The bubble is the schedule's op lists played out (planning/bubble.py) with a stage's forward, input-gradient
and weight-gradient times equal, as the zero-bubble paper assumes for transformer layers (the weight and
input gradients are one matmul each per forward matmul): what tools/benchmark_pipeline.py measures the
executor idling (docs/benchmarks.md), with the exchanges of the communication plan costing nothing over free
messages. The schedule's formula (its ScheduleSpec, parallel/pipeline/) is shown beside it: the two agree at
equal times but for the schedules whose formula is a bound (DualPipeV's)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megalite.config import Config, ConfigError
from megalite.config_fp8 import fp8_layer_numbers
from megalite.config_validation import validate
from megalite.parallel.pipeline.registry import SCHEDULES, bubble_fraction, training_schedules
from megalite.planning.activations import token_rows
from megalite.planning.bubble import simulated_bubble
from megalite.planning.context_parallel import describe as describe_cp
from megalite.planning.experts import describe as describe_moe
from megalite.planning.memory import StageMemory, gathered_bytes, grid_replicas, memory_per_stage, peak_activations
from megalite.planning.parameters import active_parameters, model_parameters, moe_layers
from megalite.training.flops import PEAK_TFLOPS, training_flops_per_token

GIB = 2**30
# Memory torch.cuda reports per device (MiB), and the row of training/flops.py's peak table.
GPUS = {
    "h100": (81_559, "H100 SXM"), "h200": (143_771, "H200"), "gh200": (97_871, "GH200"), "b200": (183_359, "B200"),
    "a100": (81_051, "A100"), "a100-40gb": (40_536, "A100"), "l40s": (46_068, "L40S"), "a10g": (22_731, "A10G"),
    "v100": (32_510, "V100"),
}
# CUDA context, NCCL buffers and allocator fragmentation: not tensors, but not free either.
RESERVED_GIB = 3.0


@dataclass(frozen=True)
class Plan:
    cfg: Config
    world_size: int
    gpu: str
    assumed_mfu: float
    stages: list[StageMemory]

    @property
    def dp(self) -> int:
        return self.cfg.data_parallel_size(self.world_size)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, which ZeRO shards the model state over: dp x cp."""
        return grid_replicas(self.cfg, self.world_size)["dense"]

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts, which their state is sharded over: edp = world / (ep x pp)."""
        return grid_replicas(self.cfg, self.world_size)["expert"]

    @property
    def microbatches(self) -> int:
        return self.cfg.num_microbatches(self.world_size)

    @property
    def parameters(self) -> int:
        return model_parameters(self.cfg.model)

    @property
    def active_parameters(self) -> int:
        """What one token uses: all but the experts it is not routed to."""
        return active_parameters(self.cfg.model)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def needed_gib(self) -> float:
        return self.worst.total / GIB + RESERVED_GIB

    @property
    def available_gib(self) -> float:
        return GPUS[self.gpu][0] / 1024

    @property
    def fits(self) -> bool:
        return self.needed_gib <= self.available_gib

    @functools.cached_property
    def bubble(self) -> float:
        """Idle fraction of the pipeline under its schedule, F = B = W: its op lists played out (module
        docstring)."""
        p = self.cfg.parallel
        return simulated_bubble(p.pipeline_schedule, p.pp, p.vp, self.microbatches)

    @property
    def bubble_formula(self) -> float:
        """The schedule's formula at F = B = W (Megatron-LM's (pp - 1) / (vp * m) for 1F1B)."""
        p = self.cfg.parallel
        return bubble_fraction(p.pipeline_schedule, p.pp, p.vp, self.microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size(self.world_size) * self.cfg.model.seq_length

    @property
    def flops_per_step(self) -> float:
        return training_flops_per_token(self.cfg.model) * self.tokens_per_step

    @property
    def peak_tflops(self) -> float | None:
        return PEAK_TFLOPS[GPUS[self.gpu][1]].get(self.cfg.train.precision)

    @property
    def step_seconds(self) -> float | None:
        peak = self.peak_tflops
        return self.flops_per_step / (self.world_size * peak * 1e12 * self.assumed_mfu) if peak else None

    def verdict(self) -> str:
        if self.fits:
            return f"fits: {self.needed_gib:.1f} GiB of {self.available_gib:.1f} GiB per {self.gpu}"
        return f"does not fit: {self.needed_gib:.1f} GiB needed, {self.available_gib:.1f} GiB available per {self.gpu}"


def schedule_plans(plan: Plan) -> list[Plan]:
    """The plan under every training schedule its layout allows, each at the vp it needs (ZB-V's 2), for pp > 1."""
    p = plan.cfg.parallel
    if p.pp == 1:
        return []
    plans = []
    for name in training_schedules():
        parallel = dataclasses.replace(p, pipeline_schedule=name, vp=SCHEDULES[name].vp or p.vp)
        cfg = dataclasses.replace(plan.cfg, parallel=parallel)
        try:
            validate(cfg, plan.world_size)
        except ConfigError:
            continue
        plans.append(make_plan(cfg, plan.world_size, plan.gpu, plan.assumed_mfu))
    return plans


def _schedule_lines(plan: Plan) -> list[str]:
    """One line per schedule: bubble, the largest stage's activations (held weight-gradient inputs included)
    and total, and whether it fits."""
    lines = []
    for other in schedule_plans(plan):
        p, w = other.cfg.parallel, other.worst
        lines.append(f"  {p.pipeline_schedule + (f' (vp {p.vp})' if p.vp != plan.cfg.parallel.vp else ''):<13} "
                     f"bubble {other.bubble:6.1%} (formula {other.bubble_formula:.1%}), activations "
                     f"{_gib(w.activations)} (stage {w.pp_rank}, {w.in_flight} in flight), {other.verdict()}")
    return ["pipeline schedules (bubble of the op lists at F = B = W, the formula's beside it; verdict):",
            *lines] if lines else []


def make_plan(cfg: Config, world_size: int, gpu: str = "h100", assumed_mfu: float = 0.4) -> Plan:
    """The plan for a config already validated for `world_size` (megalite.config_validation.validate)."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if not 0 < assumed_mfu <= 1:
        raise ValueError(f"assumed MFU {assumed_mfu} must be in (0, 1]")
    return Plan(cfg, world_size, gpu, assumed_mfu, memory_per_stage(cfg, world_size))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _gathered(plan: Plan) -> str:
    """ZeRO-3's share of the transient: whole units in backward (planning/memory.py gathered_bytes)."""
    weights, grads = gathered_bytes(plan.cfg, plan.worst.parameters, plan.replicas)
    if not weights:
        return ""
    return f" (ZeRO-3 units gathered in backward: {_gib(weights)} parameters + {_gib(grads)} gradients)"


def _moe_lines(plan: Plan) -> list[str]:
    """The mixture-of-experts lines (layers, experts, ep x edp, dispatch traffic), or none for a dense model."""
    m = plan.cfg.model
    if not m.num_experts:
        return []
    return describe_moe(plan.cfg, token_rows(plan.cfg)[1], moe_layers(m), plan.expert_replicas)


def muon_exchange(plan: Plan) -> tuple[float, float]:
    """Muon's exchange per GPU and step (parallel/muon_plan.py), in bytes: (to the matrices' owners, back). Each
    element goes to its owner once, from one of the ranks holding it (in the iteration's precision: fp32 in fp32
    training, else bf16), and comes back in fp32 to every rank that steps it."""
    cfg, parameters = plan.cfg, plan.worst.parameters
    replicas = {"dense": plan.replicas, "expert": plan.expert_replicas}
    sent = sum(n / replicas[grid] for grid, n in parameters.muon_by_grid.items())
    stepped = sent if cfg.parallel.zero >= 1 else sum(parameters.muon)
    return sent * (4 if cfg.train.precision == "fp32" else 2), stepped * 4


def _muon_lines(plan: Plan) -> list[str]:
    if plan.cfg.optim.optimizer != "muon":
        return []
    sent, back = muon_exchange(plan)
    steps = plan.worst.muon
    busiest = max(steps, key=lambda step: step.peak)
    return [f"Muon: {sum(plan.worst.parameters.muon) / 1e6:.1f} M matrix elements per GPU (one fp32 momentum each); "
            f"per step about {sent / 2**20:.1f} MiB sent to the matrices' owners and {back / 2**20:.1f} MiB back",
            f"  its update (planning/muon.py, stage {plan.worst.pp_rank}): at most {_gib(busiest.peak)} held during "
            f"the optimizer step (rank {busiest.rank}: whole matrices, Newton-Schulz temporaries, the exchange; in "
            f"the transient once activations are freed); Newton-Schulz {sum(s.flops for s in steps):.3e} FLOPs "
            f"per step over the stage, "
            f"at most {max(s.flops for s in steps):.3e} on one rank (not in MFU); that rank sends "
            f"{busiest.sent / 2**20:.1f} MiB to owners and returns {busiest.back / 2**20:.1f} MiB"]


def _fp8_lines(plan: Plan) -> list[str]:
    """Where FP8 runs and what it saves of the activations: the peak against the same run keeping every linear's
    input in train.precision (the saving is tensorwise's FP8 copies, parallel/fp8/recipes.py)."""
    t, w = plan.cfg.train, plan.worst
    if t.fp8_recipe == "none":
        return []
    kept = dataclasses.replace(plan.cfg, train=dataclasses.replace(t, fp8_recipe="none"))
    unquantised = peak_activations(kept, plan.world_size, w.pp_rank)[0]
    how = "e4m3 copies and scales kept" if t.fp8_recipe == "tensorwise" else "this recipe keeps them"
    layers = f"{len(fp8_layer_numbers(plan.cfg))} of {plan.cfg.model.num_layers} layers"
    return [f"  FP8 {t.fp8_recipe} ({layers}{', the LM head' if t.fp8_output_head else ''}): "
            f"{_gib(unquantised - w.activations)} of activations saved against linear inputs in {t.precision} "
            f"({_gib(unquantised)}; {how})"]


def _parameter_line(plan: Plan) -> str:
    active = f", {plan.active_parameters / 1e9:.3f} B active per token" if plan.cfg.model.num_experts else ""
    per_gpu = ", ".join(f"stage {s.pp_rank}: {s.parameters.total / 1e6:.1f} M" for s in plan.stages)
    return f"parameters: {plan.parameters / 1e9:.3f} B total{active}; per GPU {per_gpu}"


def _expert_state(plan: Plan) -> list[str]:
    """The experts' part of the model state above, for a mixture-of-experts model."""
    w = plan.worst
    if not plan.cfg.model.num_experts:
        return []
    return [f"  of these four, the experts' {_gib(w.expert_state)} ({w.parameters.expert / 1e6:.1f} M parameters, "
            f"replicated over edp {plan.expert_replicas}, the dense parts over dp x cp {plan.replicas}: "
            "ZeRO shards over these)"]


def format_plan(plan: Plan) -> str:
    cfg, p, m, w = plan.cfg, plan.cfg.parallel, plan.cfg.model, plan.worst
    lines = [
        f"model: {m.family}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.kv_heads} KV), ffn {m.ffn_size}, vocab {m.vocab} (padded {m.padded_vocab_size}), seq {m.seq_length}",
        f"layout: world {plan.world_size} = tp {p.tp} x cp {p.cp} x pp {p.pp} (vp {p.vp}) x dp {plan.dp}; "
        f"sequence parallel {p.sequence_parallel}; ZeRO stage {p.zero}, optimizer offload {cfg.optim.offload}",
        f"batch: global {cfg.batch_size(plan.world_size)} = {plan.microbatches} micro batches x "
        f"{cfg.train.micro_batch_size} x dp {plan.dp}; "
        f"precision {cfg.train.precision}, parameters {cfg.train.param_dtype}, recompute {cfg.train.recompute}",
        *([describe_cp(cfg)] if p.cp > 1 else []),
        *_moe_lines(plan),
        _parameter_line(plan),
        *_muon_lines(plan),
        f"memory per GPU, pipeline stage {w.pp_rank} (the largest):",
        f"  weights          {_gib(w.weights)}",
        f"  gradients        {_gib(w.gradients)}",
        f"  main weights     {_gib(w.main_weights)}",
        f"  optimizer state  {_gib(w.optimizer)}",
        *_expert_state(plan),
        f"  activations      {_gib(w.activations)} (peak: {w.in_flight} forward{'s' if w.in_flight != 1 else ''} "
        f"held for backward, recompute {cfg.train.recompute})",
        *_fp8_lines(plan),
        f"  transient        {_gib(w.transient)}{_gathered(plan)}",
        f"  reserved         {RESERVED_GIB:.2f} GiB (CUDA context, NCCL, fragmentation)",
        f"  total            {plan.needed_gib:.2f} GiB",
        f"pipeline bubble: {plan.bubble:.1%} from the op lists played out, formula {plan.bubble_formula:.1%} "
        f"({p.pipeline_schedule}, pp {p.pp}, vp {p.vp}, {plan.microbatches} micro batches, F = B = W)",
        *_schedule_lines(plan),
        f"FLOPs per step: {plan.flops_per_step:.3e} ({plan.tokens_per_step} tokens)",
    ]
    if plan.step_seconds is None:
        lines.append(f"step time: n/a ({plan.gpu} has no {cfg.train.precision} peak in megalite/training/flops.py)")
    else:
        lines.append(f"step time at {plan.assumed_mfu:.0%} MFU ({plan.peak_tflops:g} TFLOP/s peak per {plan.gpu}): "
                     f"{plan.step_seconds:.2f} s, "
                     f"{plan.tokens_per_step / plan.step_seconds / plan.world_size:,.0f} tokens/s per GPU")
    lines.append(plan.verdict())
    return "\n".join(lines)
