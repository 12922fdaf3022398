"""The micro batch and sequence of gpu_check's throughput benchmark, chosen so that Hugging Face's side fits.

tools/benchmark_throughput.py trains the same network twice in one process, megalite's then Hugging Face's, both
with fp32 parameters under bf16 autocast. Hugging Face's side is the larger: its eager layers save every
intermediate, and its loss upcasts the logits to fp32 (at an example's 8192 tokens x 2 samples and Llama 3's
128k vocabulary the logits and their gradients alone take ~27 GiB). Its estimate, summed as if every part
peaked at once (gradients in fact grow as activations are freed, so the sum errs on the safe side):

    parameters, gradients: 4 + 4 bytes per parameter (fp32); Adam: 8 (two fp32 moments)
    weight copies: 2 bytes per parameter of the layers, the bf16 casts autocast makes of their weights and
            backward keeps (measured on a CPU, which keeps none of the LM head: under 1 GiB at 128k x 2048)
    logits: 14 bytes per token and vocabulary entry: the bf16 logits and fp32 log-probabilities forward saves,
            and at the start of backward the fp32 gradients of both
    activations: per layer and token, bytes per unit of the hidden size, the MLP's width and (Llama's separate
            k and v projections) the key/value width (LAYER_BYTES); 8 per unit of the hidden size for the final
            norm's fp32 input and output

The constants are what autograd saves in GPT2LMHeadModel and LlamaForCausalLM (SDPA, bf16 autocast), counted on
a CPU with planning/measure.py's saved_storages in small models, across layers, tokens, widths and vocabularies;
the test checks them against a small model. megalite's side is the planner's figure for the benchmark's config.
The example's shape runs when both fit the device; otherwise the micro batch halves, then the sequence, until
they do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from megalite.config import Config, ModelConfig
from megalite.planning.parameters import layer_parameters, model_parameters
from megalite.planning.plan import GIB, GPUS, RESERVED_GIB, make_plan

STATE_BYTES = {"parameters": 4, "gradients": 4, "Adam state": 8}  # per parameter, fp32
WEIGHT_COPY_BYTES = 2  # per parameter of the layers
# per token and vocabulary entry: what forward saves (bf16 logits, fp32 log-probabilities), and the fp32 gradients
# of both that backward adds at its start
LOGIT_BYTES = {"saved": 6, "gradients": 8}
# per layer and token, by family: bytes per unit of (hidden size, MLP width, key/value width)
LAYER_BYTES = {"gpt2": (24, 10, 0), "llama": (30, 8, 4)}
FINAL_NORM_BYTES = 8  # per token and unit of the hidden size
ConfigAt = Callable[[int, int], Config]  # (micro batch, sequence) -> a config


@dataclass(frozen=True)
class Shape:
    micro_batch: int
    seq: int
    why: str  # the estimate behind the choice, for the run's output and the report


def hf_training_bytes(m: ModelConfig, micro_batch: int, seq: int) -> dict[str, float]:
    """Estimated peak bytes of one Hugging Face training step of `m` (fp32 parameters, bf16 autocast, AdamW),
    by what holds them; the peak is their sum."""
    if m.family not in LAYER_BYTES:
        raise ValueError(f"model.family={m.family}: no Hugging Face memory estimate for it (known: "
                         f"{', '.join(LAYER_BYTES)}); measure its constants as tests/test_gpu_check.py checks them")
    params, tokens = model_parameters(m), micro_batch * seq
    layer_params = layer_parameters(m)
    hidden, ffn, kv = LAYER_BYTES[m.family]
    layer = hidden * m.hidden_size + ffn * m.ffn_size + kv * m.kv_heads * m.head_size
    return {**{name: size * params for name, size in STATE_BYTES.items()},
            "weight copies": WEIGHT_COPY_BYTES * layer_params,
            **{f"logits ({name})": size * tokens * m.vocab for name, size in LOGIT_BYTES.items()},
            "activations": tokens * (m.num_layers * layer + FINAL_NORM_BYTES * m.hidden_size)}


def _needed_gib(example: Config, micro_batch: int, seq: int, megalite_config: ConfigAt) -> tuple[float, float]:
    """(HF's estimate, megalite's plan) in GiB at this shape, each with the planner's reserve for the CUDA
    context, NCCL and fragmentation."""
    hf = sum(hf_training_bytes(replace(example.model, seq_length=seq), micro_batch, seq).values()) / GIB
    return hf + RESERVED_GIB, make_plan(megalite_config(micro_batch, seq), 1).needed_gib


def choose_shape(example: Config, gpu: str, megalite_config: ConfigAt) -> Shape:
    """The largest micro batch (then sequence) up to the example's at which both sides of the benchmark fit `gpu`
    (planning/plan.py GPUS); `megalite_config(micro_batch, seq)` is the benchmark's megalite config at a shape."""
    available = GPUS[gpu][0] / 1024
    micro_batch, seq = example.train.micro_batch_size, example.model.seq_length
    tried = []
    while True:
        hf, megalite = _needed_gib(example, micro_batch, seq, megalite_config)
        tried.append(f"micro batch {micro_batch} x seq {seq}: HF ~{hf:.1f} GiB, megalite {megalite:.1f} GiB")
        if max(hf, megalite) <= available or (micro_batch, seq) == (1, 1):
            break
        micro_batch, seq = (micro_batch // 2, seq) if micro_batch > 1 else (1, seq // 2)
    verdict = "fits" if max(hf, megalite) <= available else "does not fit even at 1 x 1"
    return Shape(micro_batch, seq, f"{'; '.join(tried)} ({verdict} in {available:.1f} GiB on {gpu})")
