"""What train.fp8_recipe and train.fp8_param_gather ask of a run's config (read by config_validation.validate with
every other check).

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
        return _options_without_a_recipe(cfg) + _param_gather_errors(cfg)
    if t.precision == "fp16":
        return [f"train.fp8_recipe={t.fp8_recipe} needs train.precision=bf16 (or fp32), got fp16; set "
                "train.precision=bf16 (and train.param_dtype=fp32 or bf16)"]
    errors = _layer_count_errors(cfg) + _param_gather_errors(cfg)
    if t.fp8_recipe != "blockwise":
        return errors
    return errors + [f"train.fp8_recipe=blockwise tiles {what} into {BLOCK}-wide blocks, but {problem}"
                     for what, problem in _untileable_widths(cfg) + _untileable_tokens(cfg)]


def fp8_layer_numbers(cfg: Config) -> range:
    """The transformer layers, numbered along the whole model from 0 (whatever the pipeline stages hold), whose
    matmuls run train.fp8_recipe: every layer, less the first train.fp8_num_layers_at_start_in_bf16 and the last
    train.fp8_num_layers_at_end_in_bf16 with train.fp8_first_last_layers_bf16 (as Megatron-LM counts them over
    its model's --num-layers); none without a recipe. Multi-token prediction's layers follow model.num_layers,
    outside this numbering, and keep the recipe."""
    t, layers = cfg.train, cfg.model.num_layers
    if t.fp8_recipe == "none":
        return range(0)
    if not t.fp8_first_last_layers_bf16:
        return range(layers)
    return range(t.fp8_num_layers_at_start_in_bf16, layers - t.fp8_num_layers_at_end_in_bf16)


_COUNTS = ("fp8_num_layers_at_start_in_bf16", "fp8_num_layers_at_end_in_bf16")


def _options_without_a_recipe(cfg: Config) -> list[str]:
    t = cfg.train
    return [f"train.{name}=true changes which matmuls run in FP8, but train.fp8_recipe=none runs none; set "
            f"train.fp8_recipe (tensorwise, rowwise or blockwise) or drop train.{name}"
            for name in ("fp8_first_last_layers_bf16", "fp8_output_head") if getattr(t, name)]


def _layer_count_errors(cfg: Config) -> list[str]:
    """The counts of layers kept out of FP8: set only with the switch that reads them, each >= 0, together
    leaving a matmul in FP8 (a transformer layer, or the head with train.fp8_output_head)."""
    t, layers = cfg.train, cfg.model.num_layers
    counts = {name: getattr(t, name) for name in _COUNTS}
    if not t.fp8_first_last_layers_bf16:
        return [f"train.{name}={value} is read only with train.fp8_first_last_layers_bf16=true; set that too, "
                f"or drop train.{name}" for name, value in counts.items() if value != 1]
    errors = [f"train.{name}={value} must be >= 0" for name, value in counts.items() if value < 0]
    kept_out, most = sum(counts.values()), layers if t.fp8_output_head else layers - 1
    if not errors and kept_out > most:
        problem = (f"asks for more layers than model.num_layers={layers}" if kept_out > layers else
                   f"keeps every one of model.num_layers={layers} out of FP8, and the head too "
                   "(train.fp8_output_head=false): nothing would run in FP8")
        errors.append(f"train.fp8_num_layers_at_start_in_bf16 + train.fp8_num_layers_at_end_in_bf16 = {kept_out} "
                      f"{problem}; lower them (together at most {most}) or set train.fp8_recipe=none")
    return errors


def _param_gather_errors(cfg: Config) -> list[str]:
    """train.fp8_param_gather gathers FP8 bytes that serve the forward and, transposed, the input gradient, in the
    distributed optimizer's parameter gather (parallel/fp8/param_gather.py)."""
    t, p = cfg.train, cfg.parallel
    if not t.fp8_param_gather:
        return []
    if t.fp8_recipe == "none":
        return ["train.fp8_param_gather=true gathers the weights of FP8 matmuls, but train.fp8_recipe=none; set "
                "train.fp8_recipe=tensorwise (or blockwise), or train.fp8_param_gather=false"]
    if t.fp8_recipe == "rowwise":
        return ["train.fp8_param_gather=true cannot gather train.fp8_recipe=rowwise's weights in FP8: its input "
                "gradient scales the weight per input feature, which bytes scaled per output feature cannot give "
                "(they are gathered in train.param_dtype); set train.fp8_recipe=tensorwise or blockwise, or "
                "train.fp8_param_gather=false"]
    if p.zero < 1:
        return ["train.fp8_param_gather=true shares FP8 weights in the distributed optimizer's parameter gather, "
                "but parallel.zero_stage is 0; set parallel.distributed_optimizer=true (or parallel.zero_stage=1, 2 "
                "or 3), or train.fp8_param_gather=false"]
    return []


def _untileable_widths(cfg: Config) -> list[tuple[str, str]]:
    """Each per-rank contraction width of the transformer layers' matmuls (and the head's, with
    train.fp8_output_head) that is not whole tiles, with the field that sets it and a value that tiles."""
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
    if cfg.train.fp8_output_head and m.padded_vocab_size % (BLOCK * p.tp):
        problems.append(("the contracted widths", f"with train.fp8_output_head the LM head's padded vocabulary "
                         f"{m.padded_vocab_size} over parallel.tp={p.tp} is {m.padded_vocab_size / p.tp:g} rows per "
                         f"rank, not a multiple of {BLOCK}; set model.make_vocab_size_divisible_by={BLOCK * p.tp}"))
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
