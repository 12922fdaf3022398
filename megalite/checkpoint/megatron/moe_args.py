"""megalite's mixture-of-experts fields from a Megatron-LM checkpoint's `args`, and the refusal of Megatron MoE
options megalite does not compute.

Megatron-Core's routing (moe_utils.py `topk_routing_with_score_function`): softmax scores either over the k
chosen logits (its default: the same as megalite's softmax over all experts renormalised over the chosen) or,
with `--moe-router-pre-softmax`, over all experts without renormalising; sigmoid scores renormalised over the
chosen when k > 1; chosen by scores + expert bias where `--moe-router-enable-expert-bias` (the bias only
chooses), then scaled by `--moe-router-topk-scaling-factor`. Its load-balancing types `aux_loss` and
`seq_aux_loss` are megalite's switch and sequence losses; `--moe-layer-freq` (every n-th layer, or a 0/1 list
per layer) must be megalite's rule: the first k layers dense, then every n-th a mixture of experts.
"""

from __future__ import annotations

import argparse
from typing import Any

from megalite.checkpoint.megatron.state import arg

BALANCING = {"aux_loss": "moe_aux_loss_coeff", "seq_aux_loss": "moe_seq_aux_loss_coeff", "none": None}
DISPATCHERS = {"alltoall": "alltoall", "allgather": "allgather", "flex": "alltoall"}


def _layer_pattern(freq: int | list[int], num_layers: int, where: str) -> dict[str, int]:
    """megalite's first dense layers and layer frequency of Megatron's `--moe-layer-freq`."""
    if isinstance(freq, int):
        return {"moe_first_dense_layers": 0, "moe_layer_freq": freq}
    moe = [i for i, flag in enumerate(freq) if flag]
    first, every = (moe[0], moe[1] - moe[0] if len(moe) > 1 else 1) if moe else (num_layers, 1)
    if [int(bool(f)) for f in freq] != [int(i >= first and (i - first) % every == 0) for i in range(len(freq))]:
        raise ValueError(f"{where}: args.moe_layer_freq={freq} is not some dense layers, then every n-th layer "
                         "a mixture of experts (megalite's moe_first_dense_layers / moe_layer_freq)")
    return {"moe_first_dense_layers": first, "moe_layer_freq": every}


def _problems(args: argparse.Namespace, balancing: Any, score: str) -> list[str]:
    problems = []
    if balancing not in BALANCING:
        problems.append(f"args.moe_router_load_balancing_type={balancing!r} (megalite's are {', '.join(BALANCING)})")
    if score not in ("softmax", "sigmoid"):
        problems.append(f"args.moe_router_score_function={score!r} (megalite's are softmax and sigmoid)")
    if args.add_bias_linear:
        problems.append("args.add_bias_linear=True with experts (megalite's router and experts have no biases)")
    if arg(args, "moe_input_jitter_eps"):
        problems.append(f"args.moe_input_jitter_eps={args.moe_input_jitter_eps} (megalite does not jitter)")
    if arg(args, "moe_apply_probs_on_input", False):
        problems.append("args.moe_apply_probs_on_input=True (megalite weighs the experts' outputs)")
    if arg(args, "moe_router_group_topk") and score == "softmax" and not arg(args, "moe_router_pre_softmax"):
        problems.append("args.moe_router_group_topk with softmax over the chosen logits (Megatron then groups by "
                        "logits, megalite by scores)")
    if arg(args, "moe_grouped_gemm", False) and arg(args, "transformer_impl", "local") == "local":
        problems.append("args.moe_grouped_gemm=True with the local spec (the legacy GroupedMLP's weight1/weight2)")
    return problems


def moe_fields(args: argparse.Namespace, where: str) -> dict[str, Any]:
    """ModelConfig's MoE fields (none without experts); every option megalite does not compute refused at once."""
    experts = arg(args, "num_experts")
    if not experts:
        return {}
    balancing, score = arg(args, "moe_router_load_balancing_type", "aux_loss"), arg(
        args, "moe_router_score_function", "softmax")
    balancing = balancing[0] if isinstance(balancing, list) and len(balancing) == 1 else balancing
    problems = _problems(args, balancing if isinstance(balancing, str) else repr(balancing), score)
    if problems:
        raise ValueError(f"{where}: Megatron-LM MoE options megalite does not compute: {', '.join(problems)}; "
                         "this checkpoint cannot be converted")
    topk = args.moe_router_topk
    coeff = arg(args, "moe_aux_loss_coeff", 0.0)
    coeff = coeff[0] if isinstance(coeff, list) else coeff
    fields = {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": arg(args, "moe_ffn_hidden_size"),
              "moe_router": score, "moe_scaling_factor": float(arg(args, "moe_router_topk_scaling_factor") or 1.0),
              "moe_norm_topk_prob": topk > 1 if score == "sigmoid" else not arg(args, "moe_router_pre_softmax"),
              "moe_expert_bias": bool(arg(args, "moe_router_enable_expert_bias", False)),
              "moe_bias_update_rate": float(arg(args, "moe_router_bias_update_rate", 1e-3)),
              "moe_z_loss_coeff": float(arg(args, "moe_z_loss_coeff") or 0.0),
              "moe_shared_expert_size": arg(args, "moe_shared_expert_intermediate_size") or 0,
              "moe_shared_expert_gate": bool(arg(args, "moe_shared_expert_gate", False)),
              "moe_router_groups": arg(args, "moe_router_num_groups") or 1,
              "moe_router_group_topk": arg(args, "moe_router_group_topk"),
              "moe_capacity_factor": arg(args, "moe_expert_capacity_factor"),
              "moe_drop_policy": arg(args, "moe_token_drop_policy", "probs"),
              "moe_pad_to_capacity": bool(arg(args, "moe_pad_expert_input_to_capacity", False)),
              **_layer_pattern(arg(args, "moe_layer_freq", 1), args.num_layers, where)}
    if BALANCING[balancing]:
        fields[BALANCING[balancing]] = float(coeff or 0.0)
    return fields


def moe_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """ParallelConfig's expert fields: the saved run's layout, as a default."""
    if not arg(args, "num_experts"):
        return {}
    return {"ep": arg(args, "expert_model_parallel_size", 1),
            "etp": arg(args, "expert_tensor_parallel_size") or args.tensor_model_parallel_size,
            "moe_dispatcher": DISPATCHERS.get(arg(args, "moe_token_dispatcher_type", "alltoall"), "alltoall")}
