"""What one rank of a pipeline stage sends in a training step, axis by axis: the calls its layers, pipeline and
gradient buffers make, as the dry run records them (megalite/dryrun/: a collective's whole tensor, a rank's
point-to-point sends), held to its recorded calls in tests/test_plan_search.py.

- tp, per region (attention; a dense MLP), per micro batch: under sequence parallelism the column-parallel layer
  all-gathers its input and the row-parallel one reduce-scatters its output; backward all-gathers the output
  gradient, all-gathers the input again (only the local shard was kept: parallel/gemm.py) and reduce-scatters the
  input gradient. Without it, one all-reduce forward and one backward. The embedding reduces (scatters) its
  output, the LM head gathers its input. Full recompute runs each layer's forward again up to the last tensor its
  backward needs (torch's checkpoint stops there): every region's gather, but not the last region's reduction. A
  mixture-of-experts block keeps its tokens on their tp rank (each routes its own rows): its traffic is ep's and
  etp's, its shared expert's a dense MLP's. Latent attention's up-projections gather the latents (q_lora_rank,
  kv_lora_rank wide) instead of the hidden states, and its rotary key (qk_pos_emb_head_dim) is gathered forward
  and reduce-scattered backward (model/latent_attention.py); without SP each is one backward all-reduce.
- cp: planning/context_parallel.py `comm_bytes` per layer per micro batch.
- ep, etp: planning/experts.py `dispatch_calls` per mixture-of-experts layer per micro batch.
- pp: each micro batch's activation to the next chunk and its gradient to the previous one, [rows, hidden] in the
  parameters' dtype, where that chunk lives on another rank.
- dp (and edp for the experts' buffers): per gradient buffer (one per model chunk and rank grid, padded as
  parallel/bucket_layout.py pads it): ZeRO 0 all-reduces it once; 1 reduce-scatters it once and all-gathers the
  updated parameters; 2 reduce-scatters after every backward, then gathers; 3 gathers the parameters in every
  forward and backward and reduce-scatters after every backward (parallel/zero/). Under train.fp8_param_gather
  the FP8 weights' buckets are gathered as one byte per element (parallel/fp8/param_gather.py).
Left out: the few small all-reduces (the loss's, the norm's, sequence-parallel norm weights', ZeRO-3 gathers of
replicated norms).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import TORCH_DTYPES, Config
from megalite.parallel.bucket_layout import BucketLayout
from megalite.parallel.fp8.param_gather import gathered_weights
from megalite.parallel.pipeline.registry import pipeline_stage, stage_layout
from megalite.parallel.zero import unit_index
from megalite.planning import context_parallel, experts
from megalite.planning.built import rank_model, token_rows
from megalite.planning.memory import grid_replicas


@dataclass(frozen=True)
class Traffic:
    """`count` calls of kind `call` over `axis` in one step of one rank, `payload` bytes in all (module
    docstring); `per_microbatch`: they recur with every micro batch (on the schedule's critical path), else once a
    step."""

    axis: str  # tp, cp, ep, etp, pp, dp, edp
    call: str  # all_gather, reduce_scatter, all_reduce, all_to_all, send
    count: int
    payload: int
    per_microbatch: bool = True


def stage_layers(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(layers, of them mixture-of-experts layers) on pipeline rank `pp_rank`, over all its chunks."""
    ranges = stage_layout(cfg, pp_rank).chunks
    indices = [i for a, b in ranges for i in range(a, b)]
    moe = set(cfg.model.moe_layers) if cfg.model.num_experts else set()
    return len(indices), sum(i in moe for i in indices)


def tensor_parallel(cfg: Config, pp_rank: int, microbatches: int) -> list[Traffic]:
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return []
    layers, moe = stage_layers(cfg, pp_rank)
    stage = pipeline_stage(p, pp_rank)
    mlps = layers - moe + (moe if m.moe_shared_expert_size else 0)  # dense MLPs and shared experts
    outputs, ends, again = layers + mlps, stage.has_embedding + stage.has_head, cfg.train.recompute == "full"
    inputs, widths, ropes = layers + mlps, m.hidden_size * (layers + mlps), 0  # column-parallel inputs, their widths
    if m.multi_latent_attention:  # the up-projections take the latents; the rotary key enters the heads alone
        inputs, ropes = inputs + layers, layers
        widths += layers * ((m.q_lora_rank or m.hidden_size) + m.kv_lora_rank - m.hidden_size)
    row = token_rows(cfg)[0] * TORCH_DTYPES[cfg.train.precision].itemsize * microbatches  # bytes per unit of width
    rope = ropes * m.qk_pos_emb_head_dim
    reduced = (inputs + ropes + outputs + again * layers + ends,
               row * (widths + rope + m.hidden_size * (outputs + again * layers + ends)))
    if not p.sequence_parallel_active:
        return [Traffic("tp", "all_reduce", reduced[0] * microbatches, reduced[1])]
    gathers = inputs * (2 + again) + ropes * (1 + again) + outputs + ends
    gathered = row * (widths * (2 + again) + rope * (1 + again) + m.hidden_size * (outputs + ends))
    return [Traffic("tp", "all_gather", gathers * microbatches, gathered),
            Traffic("tp", "reduce_scatter", reduced[0] * microbatches, reduced[1])]


def context_parallel_traffic(cfg: Config, pp_rank: int, microbatches: int) -> list[Traffic]:
    if cfg.parallel.cp == 1:
        return []
    forward, backward = context_parallel.comm_bytes(cfg)
    layers = stage_layers(cfg, pp_rank)[0]
    cp, ring = cfg.parallel.cp, cfg.parallel.cp_comm == "p2p"
    forward_calls = cp - 1 if ring else 1  # the ring's hops, or one all-gather
    backward_calls = 2 * cp - 1 if ring else 1  # K/V again and dK/dV home, or one reduce-scatter
    hops = forward_calls * (1 + (cfg.train.recompute != "none")) + backward_calls
    calls = "send" if ring else "all_gather"
    return [Traffic("cp", calls, layers * microbatches * hops, layers * microbatches * (forward + backward))]


def expert_parallel(cfg: Config, pp_rank: int, microbatches: int) -> list[Traffic]:
    moe = stage_layers(cfg, pp_rank)[1] * microbatches
    merged: dict[tuple[str, str], tuple[int, int]] = {}
    for axis, call, count, size in experts.dispatch_calls(cfg, token_rows(cfg)[1]) if moe else []:
        calls, payload = merged.get((axis, call), (0, 0))
        merged[(axis, call)] = (calls + count * moe, payload + count * moe * size)
    return [Traffic(axis, call, calls, payload) for (axis, call), (calls, payload) in merged.items()]


def pipeline_parallel(cfg: Config, pp_rank: int, microbatches: int) -> list[Traffic]:
    """The sends of pipeline rank `pp_rank`: a forward's output and a backward's input gradient per micro batch
    and chunk, where the neighbouring chunk is held by another rank."""
    p = cfg.parallel
    if p.pp == 1:
        return []
    stage = pipeline_stage(p, pp_rank)
    rows = token_rows(cfg)[1]
    size = rows * cfg.model.hidden_size * TORCH_DTYPES[cfg.train.param_dtype].itemsize
    sends = 0
    for chunk in range(stage.vp):
        g = stage.global_chunk(chunk)
        sends += g + 1 < stage.model_chunks and stage.holder(g + 1)[0] != pp_rank
        sends += g > 0 and stage.holder(g - 1)[0] != pp_rank
    return [Traffic("pp", "send", sends * microbatches, sends * microbatches * size)]


def data_parallel(cfg: Config, buffers: dict[str, list[int]], replicas: dict[str, int],
                  microbatches: int, fp8: dict[str, int] | None = None) -> list[Traffic]:
    """The gradient buffers' calls: `buffers` the padded elements of each buffer by rank grid, `replicas` the
    ranks each grid's buffers are reduced over (planning/memory.py grid_replicas), `fp8` how many of each grid's
    elements are gathered as FP8 bytes (`fp8_gathered`)."""
    p = cfg.parallel
    grad = TORCH_DTYPES[p.grad_reduce_dtype].itemsize
    param = TORCH_DTYPES[cfg.train.param_dtype].itemsize
    calls = []
    for grid, sizes in buffers.items():
        axis, n = ("dp" if grid == "dense" else "edp"), len(sizes)
        if replicas[grid] == 1 or not n:
            continue
        stage, elements = p.zero, sum(sizes)
        if stage == 0:
            calls.append(Traffic(axis, "all_reduce", n, elements * grad, False))
            continue
        reduces = microbatches if stage >= 2 else 1
        calls.append(Traffic(axis, "reduce_scatter", n * reduces, elements * grad * reduces, stage >= 2))
        gathers = 2 * microbatches if stage == 3 else 1
        in_fp8 = (fp8 or {}).get(grid, 0)
        gathered = (elements - in_fp8) * param + in_fp8
        calls.append(Traffic(axis, "all_gather", n * gathers, gathered * gathers, stage == 3))
    return calls


def _bucket_layouts(cfg: Config, pp_rank: int, replicas: dict[str, int]) -> list[tuple[str, BucketLayout]]:
    """Each gradient buffer's layout on pipeline rank `pp_rank`, by rank grid, as parallel/ddp.py lays them out
    (one buffer per model chunk and grid), read from the rank's model built on the meta device."""
    model = rank_model(cfg, pp_rank)
    placements = model.placements_by_name()
    grid_of = {id(p): placements[name].grid for name, p in model.named_parameters()}
    units = unit_index(model.chunk_modules()) if cfg.parallel.zero >= 3 else None
    fp8 = frozenset(gathered_weights(model)) if cfg.train.fp8_param_gather else frozenset()
    layouts = []
    for params in model.chunk_parameters():
        for grid in ("dense", "expert"):
            mine = [p for p in params if grid_of[id(p)] == grid]
            if mine:
                layouts.append((grid, BucketLayout(list(reversed(mine)), cfg.parallel.bucket_size, replicas[grid],
                                                   units, fp8)))
    return layouts


def gradient_buffers(cfg: Config, world_size: int, pp_rank: int) -> dict[str, list[int]]:
    """Elements of each gradient buffer of pipeline rank `pp_rank` by rank grid, padded as parallel/ddp.py lays
    them out (one buffer per model chunk and grid), read from the rank's model built on the meta device."""
    buffers: dict[str, list[int]] = {"dense": [], "expert": []}
    for grid, layout in _bucket_layouts(cfg, pp_rank, grid_replicas(cfg, world_size)):
        buffers[grid].append(layout.size)
    return buffers


def fp8_gathered(cfg: Config, pp_rank: int, replicas: dict[str, int]) -> dict[str, int]:
    """Elements of pipeline rank `pp_rank`'s buckets gathered as FP8 bytes (train.fp8_param_gather), by grid."""
    counts = {"dense": 0, "expert": 0}
    if cfg.train.fp8_param_gather:
        for grid, layout in _bucket_layouts(cfg, pp_rank, replicas):
            counts[grid] += sum(b.end - b.start for b in layout.buckets if b.fp8)
    return counts


def step_traffic(cfg: Config, pp_rank: int, buffers: dict[str, list[int]], replicas: dict[str, int],
                 microbatches: int) -> list[Traffic]:
    """Every axis's calls of one rank of pipeline stage `pp_rank` in a step of `microbatches` micro batches."""
    return [*tensor_parallel(cfg, pp_rank, microbatches), *context_parallel_traffic(cfg, pp_rank, microbatches),
            *expert_parallel(cfg, pp_rank, microbatches), *pipeline_parallel(cfg, pp_rank, microbatches),
            *data_parallel(cfg, buffers, replicas, microbatches, fp8_gathered(cfg, pp_rank, replicas))]
