"""megalite's config from a Megatron-LM checkpoint's `args` (its argparse namespace), and the refusal of
models megalite does not compute.

Megatron's flag `--x-y` is `args.x_y`. The model section takes the network; train and optim take the batch,
schedule and Adam settings so that the run continues as it was; the parallel layout (tensor, pipeline,
sequence parallelism, distributed optimizer, virtual pipeline stages, expert parallelism) is carried over as a
default, to be overridden at launch
(a checkpoint loads at any layout). The vocabulary: Megatron pads it to a multiple of
`make_vocab_size_divisible_by * tp` and, unlike megalite, scores the padded entries too; the converted
config keeps the same padded size (megalite's divisor is Megatron's times its tp) and the real vocabulary size
where the args know it (`--vocab-size`), else the padded size (then, as in Megatron, every row is scored).
The data section (what the run reads next) is data_args.py's; the mixture-of-experts fields moe_args.py's;
multi-latent attention's and multi-token prediction's mla.py's.

Megatron-Core's q/k norms (`--qk-layernorm`) are built with the model's normalization over each head's
`kv_channels` channels, one weight shared by the heads, as megalite's qk_norm, which is RMSNorm only; their
gradients are summed over tensor-parallel ranks (finalize_model_grads), so every rank holds the same weight.
Its llama3 RoPE scaling (`--use-rope-scaling`) fixes low_freq_factor 1, high_freq_factor 4 and an original
context of 8192 (rotary_pos_embedding.py `_apply_scaling`, transformers' `_compute_llama3_parameters` step for
step, as megalite's model/rope.py), only the factor being an argument.
"""

from __future__ import annotations

import argparse
from typing import Any

from megalite.checkpoint.megatron.data_args import DataCarry, data_from_args
from megalite.checkpoint.megatron.mla import mla_fields, mtp_fields
from megalite.checkpoint.megatron.moe_args import moe_fields, moe_parallel
from megalite.checkpoint.megatron.state import arg
from megalite.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig

# args that change the network (or its optimizer) in ways megalite does not compute: the value that means
# "off", and why megalite cannot continue the run otherwise.
UNSUPPORTED = {
    "squared_relu": (False, "megalite's activations are gelu, gelu_tanh and silu"),
    "quick_geglu": (False, "megalite's activations are gelu, gelu_tanh and silu"),
    "apply_layernorm_1p": (False, "megalite's norms are not zero-centred"),
    "layernorm_zero_centered_gamma": (False, "megalite's norms are not zero-centred"),
    "qk_l2_norm": (False, "megalite's q/k norm is RMSNorm, not an L2 norm"),
    "apply_wd_to_qk_layernorm": (False, "megalite never decays norm weights"),
    "rotary_interleaved": (False, "megalite's RoPE rotates halves, not interleaved pairs"),
    "rotary_percent": (1.0, "megalite rotates every channel of a head"),
    "rotary_seq_len_interpolation_factor": (None, "megalite does not interpolate RoPE positions"),
    "no_rope_freq": (None, "megalite applies RoPE in every layer"),
    "use_mup": (False, "megalite does not scale by muP"),
    "apply_residual_connection_post_layernorm": (False, "megalite's residual adds the layer's input"),
    "decoder_first_pipeline_num_layers": (None, "megalite reads pipeline stages of equal layer counts"),
    "decoder_last_pipeline_num_layers": (None, "megalite reads pipeline stages of equal layer counts"),
    "pipeline_model_parallel_layout": (None, "megalite reads pipeline stages of equal layer counts"),
    "account_for_embedding_in_pipeline_split": (False, "megalite reads pipeline stages of equal layer counts"),
    "account_for_loss_in_pipeline_split": (False, "megalite reads pipeline stages of equal layer counts"),
}
DECAY_STYLES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "WSD": "wsd"}



def check_args(args: argparse.Namespace, where: str) -> None:
    """Refuse, naming the argument and why, a checkpoint of a model megalite does not compute."""
    problems = [f"args.{name}={arg(args, name, off)!r} ({why})" for name, (off, why) in UNSUPPORTED.items()
                if arg(args, name, off) not in (off, 0 if off is None else off)]
    normalization = arg(args, "normalization")
    if normalization not in ("LayerNorm", "RMSNorm"):
        problems.append(f"args.normalization={normalization!r} (megalite's norms are LayerNorm and RMSNorm)")
    elif arg(args, "qk_layernorm", False) and normalization != "RMSNorm":
        problems.append(f"args.qk_layernorm=True with args.normalization={normalization!r} (Megatron's q/k norms "
                        "are then LayerNorms; megalite's qk_norm is RMSNorm)")
    if arg(args, "position_embedding_type") not in ("learned_absolute", "rope"):
        problems.append(f"args.position_embedding_type={arg(args, 'position_embedding_type')!r} "
                        "(megalite's are learned_absolute and rope)")
    if arg(args, "optimizer", "adam") != "adam":
        problems.append(f"args.optimizer={args.optimizer!r} (megalite steps with AdamW)")
    if problems:
        raise ValueError(f"{where}: Megatron-LM model options megalite does not compute: {', '.join(problems)}; "
                         "this checkpoint cannot be converted")


def activation(args: argparse.Namespace) -> str:
    """The MLP nonlinearity Megatron-Core computed: SwiGLU's SiLU; GELU's tanh approximation with the bias-GELU
    fusion (on by default where linear layers have biases: fused_bias_gelu is the tanh form) or Transformer
    Engine's activation (`--use-te-activation-func`, tanh too); exact (erf) GELU otherwise. (`--openai-gelu`
    is parsed but unused by Megatron-Core's models.)"""
    if args.swiglu:
        return "silu"
    fused = arg(args, "bias_gelu_fusion", False) and args.add_bias_linear
    return "gelu_tanh" if fused or arg(args, "use_te_activation_func", False) else "gelu"


def _head_dim(args: argparse.Namespace) -> int | None:
    """Megatron's `kv_channels` where it differs from hidden / heads (megalite's default)."""
    kv_channels = arg(args, "kv_channels")
    return kv_channels if kv_channels and kv_channels * args.num_attention_heads != args.hidden_size else None


def _rope_scaling(args: argparse.Namespace) -> dict[str, Any]:
    """megalite's llama3 RoPE scaling fields: Megatron's factor and its fixed constants (module docstring); none
    without RoPE, where Megatron ignores the flag."""
    if not (arg(args, "use_rope_scaling", False) and args.position_embedding_type == "rope"):
        return {"rope_scaling": "none"}
    return {"rope_scaling": "llama3", "rope_scaling_factor": float(args.rope_scaling_factor),
            "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_positions": 8192}


def model_config(args: argparse.Namespace, where: str = "args") -> ModelConfig:
    rope = args.position_embedding_type == "rope"
    tp = args.tensor_model_parallel_size
    moe, problems = moe_fields(args, where), []
    latent = mla_fields(args, problems) | mtp_fields(args, moe, problems)
    if problems:
        raise ValueError(f"{where}: Megatron-LM model options megalite does not compute: {', '.join(problems)}; "
                         "this checkpoint cannot be converted")
    return ModelConfig(**(dict(
        family="llama" if args.swiglu or rope else "gpt2", num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None, head_dim=_head_dim(args),
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=arg(args, "vocab_size") or args.padded_vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by * tp,
        bias=args.add_bias_linear, gated_mlp=args.swiglu, norm=args.normalization.lower(),
        position_embedding="rope" if rope else "learned", tie_embeddings=not args.untie_embeddings_and_output_weights,
        qk_norm=arg(args, "qk_layernorm", False), qkv_bias=arg(args, "add_qkv_bias", False),
        activation=activation(args), rope_theta=float(arg(args, "rotary_base", 10000)), **_rope_scaling(args),
        norm_epsilon=arg(args, "norm_epsilon") or arg(args, "layernorm_epsilon", 1e-5),  # renamed in 2025
        init_std=args.init_method_std, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        **moe) | latent))


def config_from_args(args: argparse.Namespace, where: str) -> tuple[Config, DataCarry]:
    """megalite's config of the run a Megatron-LM checkpoint comes from (check_args first), and what its data
    section carried (data_args.py)."""
    check_args(args, where)
    precision = "bf16" if arg(args, "bf16", False) else "fp16" if arg(args, "fp16", False) else "fp32"
    style = arg(args, "lr_decay_style", "linear")
    if style not in DECAY_STYLES:
        raise ValueError(f"{where}: args.lr_decay_style={style!r} has no megalite equivalent "
                         f"({', '.join(DECAY_STYLES)})")
    optim = OptimConfig(
        lr=args.lr, min_lr=args.min_lr, warmup_iters=arg(args, "lr_warmup_iters") or 0,
        decay_style=DECAY_STYLES[style], decay_iters=arg(args, "lr_decay_iters"),
        wsd_decay_iters=arg(args, "lr_wsd_decay_iters"), weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad)
    train_iters = arg(args, "train_iters") or (arg(args, "train_samples") or 0) // args.global_batch_size
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                        train_iters=train_iters or TrainConfig.train_iters, seed=args.seed,
                        precision=precision, param_dtype=precision)
    parallel = ParallelConfig(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                              sequence_parallel=arg(args, "sequence_parallel", False),
                              distributed_optimizer=arg(args, "use_distributed_optimizer", False),
                              vp=arg(args, "virtual_pipeline_model_parallel_size") or 1, **moe_parallel(args))
    carry = data_from_args(args, train.train_iters * args.global_batch_size)
    return Config(model=model_config(args, where), parallel=parallel, train=train, optim=optim, data=carry.data), carry
