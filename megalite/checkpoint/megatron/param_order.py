"""Which parameters each Megatron-LM rank holds, in the order Megatron registers them: what its distributed
optimizer's flat buffers are laid out from (buffer_layout.py).

Layers: pipeline rank p's model chunk v (virtual pipeline stage) holds global layers
[(v * pp + p) * n, ...) with n = layers / (pp * vp) (Megatron's even split). The first stage's first chunk adds
the embeddings before its layers, the last stage's last chunk the final norm and the output layer after them (a
tied embedding's copy too, under pipeline parallelism: Megatron's `shared_embedding`, in a bucket of its own).

Within a layer, the order of registration (module construction: attention's linear_proj before linear_qkv,
or multi-latent attention's linear_proj before its projections, query's first, and its latent norms last, or
Transformer Engine's fused into each up-projection before its weight; the router before the experts before the
shared experts). Multi-token prediction's depths follow the decoder's final norm on the last stage's last chunk,
before the output layer: per depth enorm, hnorm, eh_proj, its transformer layer, its final_layernorm. The input
norm is its own module before the attention with the local spec (`--transformer-impl local`) and under
multi-latent attention, and fused into linear_qkv with Transformer Engine's (after linear_proj, before
linear_qkv's weight: LayerNormLinear registers its norm first); the pre-MLP norm sits before fc1 either way.
Experts: the local SequentialMLP registers expert by expert (fc1 then fc2 of each), Transformer Engine's
TEGroupedMLP all fc1 weights, then all fc2 weights.

A rank's experts: ep rank r holds experts [r * E / ep, (r + 1) * E / ep). With ep > 1 or an expert tensor
parallelism other than tp, the experts' parameters sit in buffers (and an optimizer) of their own, sharded over
the expert-data-parallel ranks; otherwise in the dense buffer with the rest.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megalite.checkpoint.megatron.names import BUFFER, EXPERT, layer_part
from megalite.checkpoint.megatron.state import arg

# A layer's tensors in the order Megatron registers them (local spec; see te_order for Transformer Engine's).
LAYER_ORDER = (
    "input_layernorm.weight", "input_layernorm.bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.weight",
    "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "self_attention.kv_layernorm.weight",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    "mlp.router.weight", "mlp.router.bias",
    "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.gate_weight",
)
# torch_dist names the input norm as Transformer Engine fuses it, whichever spec saved it.
INPUT_NORM = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias"}
BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
FINAL_NORM = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
MTP_OWN_ORDER = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # then the layer, then final_layernorm
TIED_COPIES = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class RankParam:
    """One parameter of a rank: Megatron's (global-layer) name, and for an expert its global expert index (the
    name then being the layer's stacked experts tensor)."""

    name: str
    expert: int | None = None
    shared: bool = False

    @property
    def key(self) -> str:
        return self.name if self.expert is None else f"{self.name}[{self.expert}]"


def chunks(args: argparse.Namespace) -> int:
    return arg(args, "virtual_pipeline_model_parallel_size") or 1


def chunk_layers(args: argparse.Namespace, pp_rank: int, chunk: int) -> range:
    """The global layers of pipeline rank `pp_rank`'s model chunk `chunk`."""
    pp, vp = args.pipeline_model_parallel_size, chunks(args)
    per_chunk = args.num_layers // (pp * vp)
    first = (chunk * pp + pp_rank) * per_chunk
    return range(first, first + per_chunk)


def experts_separate(args: argparse.Namespace) -> bool:
    """Whether the experts' parameters have buffers and an optimizer of their own."""
    etp = arg(args, "expert_tensor_parallel_size") or args.tensor_model_parallel_size
    return arg(args, "expert_model_parallel_size", 1) > 1 or etp != args.tensor_model_parallel_size


def _layer_key(inner: str, te: bool) -> int:
    """`te`: Transformer Engine's fused input norm (dense attention; multi-latent attention's is its own module
    under either spec)."""
    if not te:
        inner = INPUT_NORM.get(inner, inner)
    elif inner.startswith("input_layernorm."):
        inner = "self_attention.linear_qkv.layer_norm_" + inner.rsplit(".", 1)[1]
    return LAYER_ORDER.index(inner)


def _layer_parameters(names: list[str], prefix: str, te: bool, local_experts: range,
                      experts: bool | None) -> list[RankParam]:
    """One layer's parameters (its tensors `prefix` + name in `names`) in registration order."""
    inner = sorted((part[1] for part in map(layer_part, names)
                    if part and part[0] == prefix and not part[1].endswith(BUFFER[1:])),
                   key=lambda n: _layer_key(n, te))
    out = []
    for name in inner:
        if not EXPERT.fullmatch(name):
            out += [RankParam(prefix + name)] if experts is not True else []
        elif experts is not False:
            out += [RankParam(prefix + name, e) for e in local_experts]
    return out


def _mtp_parameters(names: list[str], te: bool, local_experts: range, experts: bool | None) -> list[RankParam]:
    """The multi-token-prediction depths' parameters in registration order."""
    depths = sorted({int(name.split(".")[2]) for name in names if name.startswith("mtp.layers.")})
    out = []
    for k in depths:
        own = [RankParam(f"mtp.layers.{k}.{n}") for n in MTP_OWN_ORDER] if experts is not True else []
        layer = next(part[0] for part in map(layer_part, names) if part and part[0].startswith(f"mtp.layers.{k}."))
        last = [RankParam(f"mtp.layers.{k}.final_layernorm.weight")] if experts is not True else []
        out += own + _layer_parameters(names, layer, te, local_experts, experts) + last
    return out


def chunk_parameters(names: list[str], args: argparse.Namespace, pp_rank: int, chunk: int, ep_rank: int,
                     experts: bool | None) -> list[RankParam]:
    """The parameters of one rank's model chunk in registration order, from the whole model's tensor `names`
    (global layers; experts stacked per layer): all of them (`experts` None), the experts' only (True) or the
    rest (False)."""
    pp, last_chunk = args.pipeline_model_parallel_size, chunks(args) - 1
    first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == last_chunk
    tied = not args.untie_embeddings_and_output_weights and pp > 1
    te = arg(args, "transformer_impl", "local") == "transformer_engine"
    fused_input_norm = te and not arg(args, "multi_latent_attention")
    per_rank = (arg(args, "num_experts") or 0) // arg(args, "expert_model_parallel_size", 1)
    local_experts = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    layers = chunk_layers(args, pp_rank, chunk)
    out = [RankParam(n, shared=tied and n in TIED_COPIES) for n in BEFORE if first and n in names] \
        if experts is not True else []
    for layer in layers:
        out += _layer_parameters(names, f"decoder.layers.{layer}.", fused_input_norm, local_experts, experts)
    if last and pp > 1 and any(n.startswith("mtp.") for n in names):
        raise ValueError("the distributed optimizer's state of a multi-token-prediction run at pipeline parallel "
                         f"{pp} is not read (Megatron's last stage then holds a copy of the embedding for it); "
                         "convert with --no-optimizer to carry the weights only")
    if last:
        out += [RankParam(n) for n in FINAL_NORM if n in names and experts is not True]
        out += _mtp_parameters(names, fused_input_norm, local_experts, experts)
        out += [RankParam("output_layer.weight", shared=tied)] if experts is not True and (
            tied or "output_layer.weight" in names) else []
    return _expert_order(out, te)


def _expert_order(params: list[RankParam], te: bool) -> list[RankParam]:
    """Megatron's order of a layer's experts: expert by expert (SequentialMLP), or projection by projection
    (Transformer Engine's TEGroupedMLP; the order `chunk_parameters` builds)."""
    if te:
        return params
    out, i = [], 0
    while i < len(params):
        if params[i].expert is None:
            out.append(params[i])
            i += 1
            continue
        run = [p for p in params[i:] if p.expert is not None and layer_part(p.name)[0]
               == layer_part(params[i].name)[0]]
        out += sorted(run, key=lambda p: (p.expert, EXPERT_ORDER.index(EXPERT.fullmatch(
            layer_part(p.name)[1]).group(1))))
        i += len(run)
    return out


EXPERT_ORDER = ("linear_fc1.weight", "linear_fc2.weight")
