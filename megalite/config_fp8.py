"""What train.fp8_recipe asks of a run's config (read by config_validation.validate with every other check).

FP8 needs a 16-bit-or-wider compute precision beside it: bf16 (production) or fp32 (FP8 matmuls, fp32 elsewhere:
the mode in which layouts compare). fp16 is refused: its loss scaling would scale the output gradients that the
recipes scale themselves, and no anchor trains FP8 beside fp16.

`blockwise` cuts every operand into 128-wide tiles along its contraction: a linear's input features (forward),
its output features (input gradient) and the tokens (weight gradient; DeepSeek-V3 re-tiles that operand 128 x 1
along the tokens). A tile must not straddle a rank's shard, or the layout's scales would not be the one
device's: so each rank's share of every contracted width must be whole tiles, as each sequence-parallel shard and
each context-parallel half-chunk of a micro batch's tokens must (tokens flatten sequence-major, [s, b]). Each
expert's token count is data-dependent and is padded to whole tiles instead (parallel/fp8/quantize.py).
"""

from __future__ import annotations

import math

from megalite.config import Config
from megalite.config_mla import latent_attention_widths
from megalite.parallel.fp8.recipes import BLOCK


def fp8_errors(cfg: Config, world_size: int) -> list[str]:
    t = cfg.train
    if t.fp8_recipe == "none":
        return []
    if t.precision == "fp16":
        return [f"train.fp8_recipe={t.fp8_recipe} needs train.precision=bf16 (or fp32), got fp16; set "
                "train.precision=bf16 (and train.param_dtype=fp32 or bf16)"]
    if t.fp8_recipe != "blockwise":
        return []
    return [f"train.fp8_recipe=blockwise tiles {what} into {BLOCK}-wide blocks, but {problem}"
            for what, problem in _untileable_widths(cfg) + _untileable_tokens(cfg)]


def _untileable_widths(cfg: Config) -> list[tuple[str, str]]:
    """Each per-rank contraction width of the transformer layers' matmuls that is not whole tiles, with the
    field that sets it and a value that tiles."""
    m, p = cfg.model, cfg.parallel
    dense_mlp = len(m.moe_layers) < m.num_layers
    # (width, the ranks it is split over, the field that sets it, the field's value)
    widths = [(m.hidden_size, 1, "model.hidden_size", m.hidden_size)]
    if m.multi_latent_attention:
        widths += latent_attention_widths(m, p.tp)
    else:
        widths += [(m.num_attention_heads * m.head_size, p.tp, "model.num_attention_heads * head dim", None),
                   ((m.num_attention_heads + 2 * m.kv_heads) * m.head_size, p.tp,
                    "(model.num_attention_heads + 2 * model.num_query_groups) * head dim", None)]
    if dense_mlp:
        widths.append((m.ffn_size, p.tp, "model.ffn_hidden_size", m.ffn_size))
    if m.num_experts:
        widths.append((m.expert_ffn_size, p.etp, "model.moe_ffn_hidden_size", m.expert_ffn_size))
    if m.num_experts and m.moe_shared_expert_size:
        widths.append((m.moe_shared_expert_size, p.tp, "model.moe_shared_expert_size", m.moe_shared_expert_size))
    problems = []
    for width, ranks, field, value in widths:
        if width % (BLOCK * ranks):
            split = f" split over {ranks} ranks is {width / ranks:g} per rank," if ranks > 1 else ""
            problems.append(("the contracted widths", f"{field} = {width}{split} not a multiple of {BLOCK}; "
                                                      f"{_fix(field, value, width, BLOCK * ranks)}"))
    return problems


def _fix(field: str, value: int | None, width: int, step: int) -> str:
    if value is None or value != width:  # a product of fields: name the width that tiles
        return (f"make the whole a multiple of {step} (e.g. {math.ceil(width / step) * step}) through the head dim "
                "or the head counts")
    return f"set {field}={math.ceil(width / step) * step} (a multiple of {step})"


def _untileable_tokens(cfg: Config) -> list[tuple[str, str]]:
    """The tokens a weight gradient contracts over: a micro batch's, cut by context parallelism into 2 * cp
    half-chunks and by sequence parallelism into tp shards; each piece must be whole tiles."""
    m, p, mbs = cfg.model, cfg.parallel, cfg.train.micro_batch_size
    pieces = [(1, "a micro batch")]
    if p.cp > 1:
        pieces.append((2 * p.cp, f"each of the 2 * parallel.cp={p.cp} half-chunks"))
    if p.sequence_parallel_active:
        pieces.append((p.cp * p.tp, f"each sequence-parallel shard (parallel.tp={p.tp})"))
    problems = []
    for parts, what in pieces:
        step = BLOCK * parts // math.gcd(BLOCK * parts, mbs)  # seq_length must be a multiple of this
        if m.seq_length % step:
            tokens = mbs * m.seq_length / parts
            problems.append(("the tokens of the weight gradients", f"{what} holds train.micro_batch_size * "
                             f"model.seq_length / {parts} = {tokens:g} tokens, not a multiple of {BLOCK}; set "
                             f"model.seq_length={math.ceil(m.seq_length / step) * step}"))
    return problems
