"""megalite's config from a Megatron-LM checkpoint's `args` (its argparse namespace), and the refusal of
models megalite does not compute.

Megatron's flag `--x-y` is `args.x_y`. The model section takes the network; train and optim take the batch,
schedule and Adam settings so that the run continues as it was; the parallel layout (tensor, pipeline,
sequence parallelism, distributed optimizer) is carried over as a default, to be overridden at launch
(a checkpoint loads at any layout). The vocabulary: Megatron pads it to a multiple of
`make_vocab_size_divisible_by * tp` and, unlike megalite, scores the padded entries too; the converted
config keeps the same padded size (megalite's divisor is Megatron's times its tp) and the real vocabulary size
where the args know it (`--vocab-size`), else the padded size (then, as in Megatron, every row is scored).
"""

from __future__ import annotations

import argparse
from typing import Any

from megalite.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig

# args that change the network in ways megalite does not compute, with the value that means "off".
UNSUPPORTED = {
    "num_experts": None, "multi_latent_attention": False, "qk_layernorm": False, "mtp_num_layers": None,
    "squared_relu": False, "quick_geglu": False, "apply_layernorm_1p": False, "layernorm_zero_centered_gamma": False,
    "qk_l2_norm": False, "rotary_interleaved": False,
    "use_rope_scaling": False, "apply_residual_connection_post_layernorm": False, "rotary_percent": 1.0,
    "virtual_pipeline_model_parallel_size": None, "expert_model_parallel_size": 1,
}
DECAY_STYLES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "WSD": "wsd"}


def _arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def check_args(args: argparse.Namespace, where: str) -> None:
    """Refuse, naming the argument, a checkpoint of a model megalite does not compute."""
    problems = [f"args.{name}={_arg(args, name, off)!r}" for name, off in UNSUPPORTED.items()
                if _arg(args, name, off) not in (off, 0 if off is None else off)]
    if _arg(args, "normalization") not in ("LayerNorm", "RMSNorm"):
        problems.append(f"args.normalization={_arg(args, 'normalization')!r}")
    if _arg(args, "position_embedding_type") not in ("learned_absolute", "rope"):
        problems.append(f"args.position_embedding_type={_arg(args, 'position_embedding_type')!r}")
    kv_channels = _arg(args, "kv_channels")
    if kv_channels and kv_channels * args.num_attention_heads != args.hidden_size:
        problems.append(f"args.kv_channels={kv_channels} (megalite's head size is hidden_size / heads)")
    if _arg(args, "add_qkv_bias", False) and not _arg(args, "add_bias_linear", True):
        problems.append("args.add_qkv_bias=True without add_bias_linear (megalite's biases are all or none)")
    if _arg(args, "optimizer", "adam") != "adam":
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
    fused = _arg(args, "bias_gelu_fusion", False) and args.add_bias_linear
    return "gelu_tanh" if fused or _arg(args, "use_te_activation_func", False) else "gelu"


def model_config(args: argparse.Namespace) -> ModelConfig:
    rope = args.position_embedding_type == "rope"
    tp = args.tensor_model_parallel_size
    return ModelConfig(
        family="llama" if args.swiglu or rope else "gpt2", num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=_arg(args, "vocab_size") or args.padded_vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by * tp,
        bias=args.add_bias_linear, gated_mlp=args.swiglu, norm=args.normalization.lower(),
        position_embedding="rope" if rope else "learned", tie_embeddings=not args.untie_embeddings_and_output_weights,
        qk_norm=False, activation=activation(args), rope_theta=float(_arg(args, "rotary_base", 10000)),
        norm_epsilon=_arg(args, "norm_epsilon") or _arg(args, "layernorm_epsilon", 1e-5),  # renamed in 2025
        init_std=args.init_method_std, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout)


def config_from_args(args: argparse.Namespace, where: str) -> Config:
    """megalite's config of the run a Megatron-LM checkpoint comes from (check_args first)."""
    check_args(args, where)
    precision = "bf16" if _arg(args, "bf16", False) else "fp16" if _arg(args, "fp16", False) else "fp32"
    style = _arg(args, "lr_decay_style", "linear")
    if style not in DECAY_STYLES:
        raise ValueError(f"{where}: args.lr_decay_style={style!r} has no megalite equivalent "
                         f"({', '.join(DECAY_STYLES)})")
    optim = OptimConfig(
        lr=args.lr, min_lr=args.min_lr, warmup_iters=_arg(args, "lr_warmup_iters") or 0,
        decay_style=DECAY_STYLES[style], decay_iters=_arg(args, "lr_decay_iters"),
        wsd_decay_iters=_arg(args, "lr_wsd_decay_iters"), weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                        train_iters=_arg(args, "train_iters") or TrainConfig.train_iters, seed=args.seed,
                        precision=precision, param_dtype=precision)
    parallel = ParallelConfig(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                              sequence_parallel=_arg(args, "sequence_parallel", False),
                              distributed_optimizer=_arg(args, "use_distributed_optimizer", False))
    return Config(model=model_config(args), parallel=parallel, train=train, optim=optim)
