"""One typed configuration for a training run.

Every knob lives in a dataclass section, here or in config_sections.py (families' features: config_features.py;
latent attention's fields: config_mla.py), with its default and a one-line doc (`pretrain_gpt.py --help` prints
them). A run's config is built once from a YAML file plus `--section.field=value` overrides (`megalite.config_cli`)
and validated once by `config_validation.validate()`, which reports every problem together with the fix, so a bad
job fails in the first second instead of after queueing on a cluster."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from megalite.config_features import FAMILY_FEATURES, ROPE_SCALING_DEFAULTS, Activation, Features
from megalite.config_mla import LatentAttentionFields
from megalite.config_mtp import MultiTokenPredictionFields
from megalite.config_sections import CheckpointConfig, DataConfig, LoggingConfig
from megalite.config_sections import documented as _f
from megalite.errors import InvalidInput


class ConfigError(InvalidInput):
    """A configuration problem the user must fix; the message says which field and how."""

    problems: list[str] = []  # each problem, when raised by raise_if

    @classmethod
    def raise_if(cls, errors: list[str]) -> None:
        """Raise one error listing every problem at once, if there is any."""
        if errors:
            error = cls("invalid configuration:\n  - " + "\n  - ".join(errors))
            error.problems = errors
            raise error


def __getattr__(name: str) -> Any:
    """TORCH_DTYPES, what train.precision, train.param_dtype and parallel.grad_reduce_dtype name, made on first
    use: the config (and `pretrain_gpt.py --help`) need no torch, which takes seconds to import."""
    if name == "TORCH_DTYPES":
        import torch

        globals()[name] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DEFAULT_VOCAB = 50257  # GPT-2's: what mock data draws from when nothing sets model.vocab_size


@dataclass
class ModelConfig(LatentAttentionFields, MultiTokenPredictionFields):
    family: Literal["gpt2", "llama", "qwen2", "qwen3", "gpt_oss"] = _f(
        "gpt2", "gpt2: learned positions, LayerNorm, GELU (tanh), biases, tied embeddings; "
                "llama: RoPE, RMSNorm, SwiGLU, no biases; qwen2: llama's with q/k/v biases; qwen3: llama's with "
                "qk_norm; gpt_oss: llama's with biases, attention sinks, a router bias and the clamped quick-GELU "
                "GLU (the defaults of the feature fields below); with num_experts > 0 llama is Mixtral, qwen2 "
                "Qwen2-MoE, qwen3 Qwen3-MoE")
    num_layers: int = _f(2, "number of transformer layers")
    hidden_size: int = _f(128, "model width")
    num_attention_heads: int = _f(4, "query heads")
    num_query_groups: int | None = _f(
        None, "key/value heads for grouped-query attention (default: num_attention_heads)")
    head_dim: int | None = _f(
        None, "width of each query/key/value head (default: hidden_size / num_attention_heads; Qwen3 sets 128 "
              "whatever its width)")
    ffn_hidden_size: int | None = _f(
        None, "MLP width (default: 4*hidden, or 8/3*hidden rounded up to 64 with a gated MLP)")
    seq_length: int = _f(128, "tokens per sample")
    max_position_embeddings: int | None = _f(
        None, "positions the model covers: rows of the learned table or of RoPE's (default: seq_length)")
    vocab_size: int | None = _f(
        None, "ids the model embeds (default: continuing a checkpoint, the checkpoint's; else the tokenizer's, its "
              "largest id + 1; 50257 with mock data). Set it above the tokenizer's ids for a released model's larger "
              "embedding (Qwen3-8B: 151936 rows, 151669 ids); with NullTokenizer its ids are this + 1 (Megatron's)")
    make_vocab_size_divisible_by: int = _f(
        128, "pad the vocabulary to a multiple of this; padded entries never take probability mass")
    bias: bool | None = _f(
        None, "biases in the linear layers, the routed experts' included; LayerNorm keeps its own (default: gpt2 "
              "and gpt_oss true, llama false)")
    gated_mlp: bool | None = _f(
        None, "gated MLP: activation(gate) * up, two input projections (SwiGLU with silu; default: gpt2 false, "
              "llama true)")
    activation: Activation | None = _f(
        None, "the MLP's (and experts') nonlinearity: gelu_tanh (GELU's tanh approximation), gelu (exact, erf), "
              "silu, quick_gelu (x * sigmoid(1.702 x)) (default: gpt2 gelu_tanh, llama and qwen silu, gpt_oss "
              "quick_gelu)")
    glu_limit: float | None = _f(
        None, "a gated MLP's (and the experts') gate is clamped to at most this and its up projection to "
              "[-limit, limit] before activation(gate) * (up + glu_linear_offset) (gpt-oss: 7; default: the "
              "family's, none but gpt_oss)")
    glu_linear_offset: float | None = _f(
        None, "a gated MLP multiplies activation(gate) by (up + this) (gpt-oss: 1; default: the family's, 0 but "
              "gpt_oss)")
    norm: Literal["layernorm", "rmsnorm"] | None = _f(
        None, "normalisation layers (default: gpt2 layernorm, llama rmsnorm)")
    position_embedding: Literal["learned", "rope"] | None = _f(
        None, "learned: a position table added to the embeddings; rope: rotary (default: gpt2 learned, llama rope)")
    tie_embeddings: bool | None = _f(
        None, "share input embedding and LM head (default: true for gpt2, false for llama)")
    qk_norm: bool | None = _f(
        None, "RMSNorm over each query and key head before RoPE (default: qwen3 true, the others false)")
    qkv_bias: bool | None = _f(
        None, "biases on the query/key/value projection only, as Qwen2 (model.bias puts them in every linear "
              "layer; default: qwen2 true, the others false)")
    attention_sinks: bool | None = _f(
        None, "a learned logit per head joins every query's softmax as a column with no value, so a head can attend "
              "to nothing (gpt-oss; default: gpt_oss true, the others false)")
    sliding_window: int | None = _f(
        None, "the layers of sliding_window_layers attend only to the last this many positions, the query's own "
              "included (a query at q sees keys at k with q - k < window: Hugging Face's rule); none: full causal")
    sliding_window_layers: list[int] | None = _f(
        None, "which layers (global indices from 0) have the sliding window (default: every layer, as Mistral; "
              "gpt-oss: the even ones)")
    rope_theta: float = _f(10000.0, "RoPE base frequency (position_embedding=rope)")
    rope_scaling: Literal["none", "llama3", "yarn"] = _f(
        "none", "RoPE frequency scaling: none; llama3 (Llama-3.1/3.2: wavelengths longer than "
                "rope_original_max_positions / rope_low_freq_factor slowed by rope_scaling_factor, those shorter "
                "than rope_original_max_positions / rope_high_freq_factor kept, a smooth blend between); or yarn "
                "(YaRN, gpt-oss: frequencies interpolated by rope_scaling_factor below rope_beta_slow rotations over "
                "the original context, kept above rope_beta_fast, a linear ramp between; cos and sin scaled)")
    rope_scaling_factor: float | None = _f(
        None, "RoPE scaling factor (default: llama3 8 as Llama-3.1, Llama-3.2 has 32; yarn 32 as gpt-oss)")
    rope_low_freq_factor: float = _f(1.0, "llama3 RoPE scaling: low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 RoPE scaling: high_freq_factor")
    rope_original_max_positions: int | None = _f(
        None, "RoPE scaling: the context the model was first trained at (default: llama3 8192, yarn 4096)")
    rope_beta_fast: float = _f(32.0, "yarn RoPE scaling: rotations over the original context above which a "
                                     "frequency is kept (beta_fast)")
    rope_beta_slow: float = _f(1.0, "yarn RoPE scaling: rotations below which a frequency is interpolated (beta_slow)")
    rope_mscale: float | None = _f(
        None, "yarn RoPE scaling: cos and sin are scaled by mscale(factor, rope_mscale) / mscale(factor, "
              "rope_mscale_all_dim), mscale(f, m) = 0.1 m ln f + 1, when both are set; by 0.1 ln(factor) + 1 "
              "otherwise (gpt-oss)")
    rope_mscale_all_dim: float | None = _f(None, "yarn RoPE scaling: see rope_mscale")
    rope_truncate: bool = _f(
        True, "yarn RoPE scaling: round the ramp's bounds outwards to whole dimensions (transformers' truncate; "
              "gpt-oss false)")
    norm_epsilon: float = _f(1e-5, "epsilon of LayerNorm / RMSNorm")
    init_std: float = _f(0.02, "std of the normal init; output projections use init_std/sqrt(2*num_layers)")
    hidden_dropout: float = _f(0.0, "dropout after attention and MLP (and on embeddings)")
    attention_dropout: float = _f(0.0, "dropout on attention probabilities")
    num_experts: int = _f(0, "routed experts per mixture-of-experts layer (0: every layer has a dense MLP)")
    moe_topk: int = _f(2, "experts each token is routed to")
    moe_ffn_hidden_size: int | None = _f(None, "width of each routed expert's MLP (default: the MLP width)")
    moe_router: Literal["softmax", "sigmoid"] = _f(
        "softmax", "expert scores: softmax over all experts (Mixtral, Qwen3-MoE) or a sigmoid each (DeepSeek-V3)")
    moe_norm_topk_prob: bool = _f(
        True, "renormalise the chosen experts' scores to sum to 1 (Mixtral's softmax over the k chosen logits; "
              "Qwen3-MoE's norm_topk_prob; DeepSeek-V3's sigmoid normalisation)")
    moe_scaling_factor: float = _f(1.0, "multiply the chosen experts' weights by this (DeepSeek-V3: 2.5)")
    moe_router_groups: int = _f(
        1, "group-limited routing: experts fall into this many equal groups (DeepSeek-V3: 8 nodes' worth)")
    moe_router_group_topk: int | None = _f(
        None, "group-limited routing: tokens choose experts only in this many best groups (default: all groups)")
    moe_aux_loss_coeff: float = _f(0.0, "switch-transformer load-balancing loss per micro batch (0: off)")
    moe_seq_aux_loss_coeff: float = _f(0.0, "sequence-level load-balancing loss (DeepSeek-V3; 0: off)")
    moe_z_loss_coeff: float = _f(0.0, "router z-loss: mean squared logsumexp of the router logits (0: off)")
    moe_expert_bias: bool = _f(
        False, "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores to choose experts "
               "(never to weigh them), moved after each step towards the experts that got fewer tokens")
    moe_bias_update_rate: float = _f(1e-3, "how far each step moves the expert bias (DeepSeek-V3's gamma)")
    moe_shared_expert_size: int = _f(0, "width of an always-on shared expert MLP next to the routed ones (0: none)")
    moe_shared_expert_gate: bool = _f(False, "scale the shared expert's output by a sigmoid gate (Qwen2-MoE)")
    moe_capacity_factor: float | None = _f(
        None, "each expert takes at most factor * tokens * k / experts of a rank's (token, choice) pairs per micro "
              "batch, the rest dropped (their weight lost; the residual and shared expert still carry the token); "
              "none: dropless")
    moe_drop_policy: Literal["probs", "position"] = _f(
        "probs", "with a capacity, which pairs an expert keeps: the highest router weights, or the first tokens")
    moe_pad_to_capacity: bool = _f(
        False, "with a capacity, give every expert exactly its capacity (zero-weight padding): the all-to-all's "
               "sizes are then known in advance, with no read of the device")
    moe_router_bias: bool | None = _f(
        None, "a learned bias on the router's logits, in choosing and weighing experts (gpt-oss; default: gpt_oss "
              "true, the others false)")
    moe_first_dense_layers: int = _f(0, "the first this many layers keep a dense MLP (DeepSeek-V3: 3)")
    moe_layer_freq: int = _f(1, "after the first dense layers, every this-many-th layer is a mixture of experts")

    def window(self, index: int) -> int | None:
        """The sliding window of layer `index` (global, from 0): how many positions a query sees, or None (all)."""
        if self.sliding_window is None or (self.sliding_window_layers is not None
                                           and index not in self.sliding_window_layers):
            return None
        return self.sliding_window

    @property
    def rope_factor(self) -> float:
        """model.rope_scaling_factor, or its default for the scaling type (1 without scaling)."""
        if self.rope_scaling_factor is not None:
            return self.rope_scaling_factor
        return ROPE_SCALING_DEFAULTS.get(self.rope_scaling, (1.0, 0))[0]

    @property
    def rope_original_positions(self) -> int:
        """model.rope_original_max_positions, or its default for the scaling type (the context without scaling)."""
        if self.rope_original_max_positions is not None:
            return self.rope_original_max_positions
        return ROPE_SCALING_DEFAULTS.get(self.rope_scaling, (1.0, self.positions))[1]

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """Each attention head's width: model.head_dim, or hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def features(self) -> Features:
        """The family's features with every set feature field in their place; derived on each read,
        so a family changed after construction changes the defaults too."""
        chosen = {f.name: getattr(self, f.name) for f in dataclasses.fields(Features)}
        return dataclasses.replace(FAMILY_FEATURES[self.family], **{k: v for k, v in chosen.items() if v is not None})

    @property
    def ffn_size(self) -> int:
        """A gated MLP's two input projections get 2/3 of the width each, keeping the parameters of 4*hidden."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.features.gated_mlp:
            return 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        return 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers (global indices, from 0) with routed experts instead of a dense MLP (`has_experts`)."""
        return tuple(i for i in range(self.num_layers) if self.has_experts(i))

    def has_experts(self, index: int) -> bool:
        """Whether layer `index` (global, from 0; MTP's depths continue after num_layers) has routed experts: every
        moe_layer_freq-th after the first moe_first_dense_layers."""
        first = self.moe_first_dense_layers
        return bool(self.num_experts) and index >= first and (index - first) % self.moe_layer_freq == 0

    @property
    def tied(self) -> bool:
        return self.features.tie_embeddings

    @property
    def positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def vocab(self) -> int:
        """The ids the model embeds: model.vocab_size, GPT-2's when nothing set it (mock data; a run with a
        tokenizer or a checkpoint sets it first, training/vocabulary.py)."""
        return DEFAULT_VOCAB if self.vocab_size is None else self.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return m * math.ceil(self.vocab / m)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor-parallel size")
    pp: int = _f(1, "pipeline-parallel size")
    cp: int = _f(1, "context-parallel size: every sample's sequence is split over cp ranks, each layer's "
                    "attention runs over the whole sequence by passing keys and values around them")
    cp_comm: Literal["p2p", "allgather"] = _f(
        "p2p", "how context-parallel attention sees the other ranks' keys and values: p2p (ring attention, "
               "overlapped with the blocks) or allgather (all of them gathered once per layer)")
    ep: int = _f(1, "expert-parallel size: each rank holds num_experts/ep experts; carved out of the tp*cp*dp ranks "
                    "of a pipeline stage (the expert grid folds over the dense one: ep may exceed dp)")
    etp: int = _f(1, "expert-tensor-parallel size: each expert's MLP split over this many ranks, as tp splits the "
                     "dense MLP (independent of tp; parallel.etp * parallel.ep ranks hold one copy of the experts)")
    moe_dispatcher: Literal["alltoall", "allgather"] = _f(
        "alltoall", "how tokens reach their experts' ranks: alltoall (each token to the ranks of its experts, "
                    "uneven splits) or allgather (every rank sees all tokens of the expert-parallel group; small ep)")
    vp: int = _f(1, "virtual pipeline stages per pipeline rank (interleaved 1F1B when > 1)")
    pipeline_schedule: str = _f(
        "1f1b", "the pipeline schedule, by its registered name (--help lists them below; each is a ScheduleSpec "
                "in parallel/pipeline/)")
    first_stage_layers: int | None = _f(
        None, "layers of the first pipeline chunk (it also holds the embedding); the rest are split evenly")
    last_stage_layers: int | None = _f(None, "layers of the last pipeline chunk (it also holds the head and loss)")
    sequence_parallel: bool = _f(
        False, "shard norm/dropout activations along the sequence inside the tensor-parallel group")
    distributed_optimizer: bool = _f(
        False, "shard optimizer state and fp32 main weights across data-parallel ranks (ZeRO-1; "
               "the same as parallel.zero_stage=1)")
    zero_stage: int | None = _f(
        None, "what data-parallel ranks shard (DeepSpeed's stages; Megatron-FSDP's strategies): 0 nothing; "
              "1 optimizer state and fp32 main weights (optim); 2 also gradients (optim_grads); "
              "3 also parameters, gathered per layer around its use (optim_grads_params) "
              "(default: 1 with parallel.distributed_optimizer, else 0)")
    bucket_size: int = _f(40_000_000, "gradient elements per data-parallel reduction bucket")
    overlap_grad_reduce: bool = _f(True, "reduce each bucket as soon as its gradients are ready, during backward")
    overlap_param_gather: bool = _f(
        False, "zero stages 1-2: all-gather updated parameters in the background, each bucket awaited by "
               "the next forward's first use (stage 3 always gathers ahead, one layer in advance)")
    grad_reduce_dtype: Literal["fp32", "bf16"] = _f(
        "fp32", "dtype gradients accumulate and are reduced in (bf16 halves the traffic, loses precision)")
    timeout_minutes: float = _f(
        10.0, "collective timeout: a rank that died or hangs makes the "
              "others fail after this long instead of waiting forever")

    @property
    def zero(self) -> int:
        """The ZeRO stage in force: zero_stage, or its alias distributed_optimizer (1), or 0."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 1 if self.distributed_optimizer else 0

    @property
    def sequence_parallel_active(self) -> bool:
        """Sequence parallelism shards along the tensor-parallel group, so with tp = 1 it changes nothing."""
        return self.sequence_parallel and self.tp > 1


@dataclass
class TrainConfig:
    micro_batch_size: int = _f(1, "samples per micro batch per data-parallel rank")
    global_batch_size: int | None = _f(
        None, "samples per optimizer step (default: micro_batch_size * dp); "
              "must be a multiple of micro_batch_size * dp")
    train_iters: int = _f(100, "optimizer steps to train for")
    exit_interval: int | None = _f(
        None, "stop cleanly when the step is a multiple of this (saving a checkpoint when checkpoint.save is set)")
    exit_duration_mins: float | None = _f(
        None, "stop cleanly (saving a checkpoint) once this many minutes have passed since start, "
              "e.g. before a job's wall-clock limit")
    max_skipped_steps: int = _f(
        10, "stop (saving the last good state) after this many "
            "consecutive steps skipped for a NaN/Inf loss or gradient norm")
    seed: int = _f(1234, "seed of init, data order and dropout")
    precision: Literal["fp32", "bf16", "fp16"] = _f(
        "fp32", "fp32; bf16 autocast; fp16 autocast with dynamic loss scaling")
    param_dtype: Literal["fp32", "bf16", "fp16"] = _f(
        "fp32", "dtype of the model's parameters; bf16/fp16 "
                "(= train.precision) keep fp32 main weights in the optimizer, as Megatron-LM's --bf16")
    fp8_recipe: Literal["none", "tensorwise", "rowwise", "blockwise"] = _f(
        "none", "FP8 matmuls in the transformer layers' linears and experts (embeddings, head, routers stay in "
                "train.precision): tensorwise (a scale per tensor), rowwise (per row), blockwise (DeepSeek-V3's "
                "1x128 / 128x128 tiles); needs train.precision bf16 or fp32 (parallel/fp8/recipes.py)")
    fp8_first_last_layers_bf16: bool = _f(
        False, "keep the first train.fp8_num_layers_at_start_in_bf16 and the last "
               "train.fp8_num_layers_at_end_in_bf16 transformer layers out of FP8, in train.precision "
               "(Megatron-LM's --first-last-layers-bf16)")
    fp8_num_layers_at_start_in_bf16: int = _f(
        1, "with train.fp8_first_last_layers_bf16: how many of the first transformer layers stay out of FP8")
    fp8_num_layers_at_end_in_bf16: int = _f(
        1, "with train.fp8_first_last_layers_bf16: how many of the last transformer layers stay out of FP8")
    fp8_output_head: bool = _f(
        False, "run the LM head's matmuls in FP8 too (default: the head stays in train.precision, as DeepSeek-V3 "
               "and torchtitan keep it)")
    fp8_param_gather: bool = _f(
        False, "all-gather the FP8 matmuls' weights as FP8 bytes (half of bf16's traffic), quantised once per step "
               "by the ranks owning their slices and used as the matmuls' weight operand (Megatron-LM's "
               "--fp8-param-gather); needs train.fp8_recipe tensorwise or blockwise and the distributed optimizer "
               "or ZeRO-3 (parallel/fp8/param_gather.py)")
    recompute: Literal["none", "selective", "full"] = _f(
        "none", "activation recompute: selective = core attention (with latent attention's up-projections) and "
                "the experts' activation, full = whole layers")
    eval_interval: int | None = _f(
        None, "evaluate on the validation set every this many steps (and at the end); none disables")
    eval_iters: int = _f(10, "global batches per evaluation")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto: cuda when available (one GPU per LOCAL_RANK), else cpu")
    compile: bool = _f(False, "torch.compile each transformer layer")
    fusions: bool = _f(True, "norms in their input's dtype under autocast; SwiGLU and RoPE as one compiled kernel "
                             "each way on CUDA (model/fused.py); false: torch's eager forms")
    allow_tf32: bool = _f(True, "fp32 matmuls and convolutions on CUDA may use TF32 tensor cores (10-bit mantissa "
                                "inputs, fp32 accumulation; about 8x the fp32 rate on an H100); false for exact fp32")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(3e-5, "learning rate at the end of decay")
    warmup_iters: int = _f(0, "linear warmup steps")
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = _f(
        "cosine", "decay after warmup; wsd = constant then decay over optim.wsd_decay_iters")
    decay_iters: int | None = _f(None, "steps from start to the end of decay (default: train.train_iters)")
    wsd_decay_iters: int | None = _f(None, "length of the final decay phase of wsd (default: 20% of decay_iters)")
    weight_decay: float = _f(0.1, "decoupled weight decay (not applied to biases and norms)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    optimizer: Literal["adamw", "muon"] = _f(
        "adamw", "muon: Muon for the layers' hidden weight matrices (AdamW for embeddings, head, norms, biases)")
    muon_momentum: float = _f(0.95, "Muon's Nesterov momentum")
    muon_ns_steps: int = _f(5, "Muon's quintic Newton-Schulz iterations")
    muon_scale: Literal["rms", "spectral"] = _f(
        "rms", "Muon's update scale: rms = 0.2 * sqrt(max(A, B)) (Moonlight: AdamW's lr and weight decay carry "
        "over); spectral = sqrt(max(1, A / B)) (Keller Jordan's)")
    muon_split_heads: bool = _f(False, "Muon: orthogonalise each attention head's q, k and v rows separately")
    muon_routers: bool = _f(True, "Muon for the MoE routers too (Moonlight); false keeps AdamW for them")
    qk_clip_threshold: float | None = _f(
        None, "MuonClip's QK-clip (Kimi K2: 100): after each step, rescale the q/k weights of heads whose largest "
        "attention logit exceeded this")
    offload: Literal["none", "cpu"] = _f(
        "none", "cpu: keep fp32 main weights and Adam's state in host memory and step there (ZeRO-Offload)")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this; 0 disables")
    initial_loss_scale: float = _f(2.0**32, "fp16: starting loss scale")
    min_loss_scale: float = _f(1.0, "fp16: the scale never drops below this")
    loss_scale_window: int = _f(1000, "fp16: double the scale after this many steps without overflow")
    hysteresis: int = _f(2, "fp16: overflows tolerated before the scale is halved")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.parallel.tp * self.parallel.cp * self.parallel.pp)

    def batch_size(self, world_size: int) -> int:
        return self.train.global_batch_size or self.train.micro_batch_size * self.data_parallel_size(world_size)

    def num_microbatches(self, world_size: int) -> int:
        return self.batch_size(world_size) // (self.train.micro_batch_size * self.data_parallel_size(world_size))


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
