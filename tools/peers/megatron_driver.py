"""Megatron-Core's own training loop (`megatron.training.pretrain`) on synthetic tokens: tools/gpu_check.py's peers
step runs it beside megalite. megatron-core's wheel holds the training package but not Megatron-LM's entry script;
this is a short one of our own (no Megatron code copied), for a machine without Transformer Engine or apex:

    torchrun --standalone --nproc_per_node=1 tools/peers/megatron_driver.py --attention sdpa -- MEGATRON_ARGS...

MEGATRON_ARGS are Megatron's own command-line arguments; with `--transformer-impl local` Megatron builds its
GPT from its own modules (`get_gpt_layer_local_spec`). `--attention` picks the core attention inside that spec:
  local  Megatron's DotProductAttention: unfused baddbmm, softmax, bmm (the probabilities kept for backward);
         a lower bound of Megatron, whose fast path is Transformer Engine's fused attention.
  sdpa   the same layer with torch's scaled_dot_product_attention (flash attention on Hopper) in its place:
         Megatron with a fused attention kernel, as close to its Transformer Engine path as torch alone gets.
Data: random tokens (seeded), labels the next token, every position in the loss; no tokenizer, no index files,
so Megatron's dataset helpers (C++ compiled by `make` at start-up) are not needed and their build is skipped.

Each optimizer step prints one line, `peer-step <seconds> <tokens> <peak allocated GiB>` (timed between device
synchronizations), and the built model one `peer-model parameters=<count> vocabulary=<padded size>`: gpu_check
reads those, so that every peer is timed and checked the same way. `--cpu` (tests only) runs on a CPU with gloo
through the stand-ins of tests/fixtures/megatron/cpu_standins.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this driver's options, Megatron's arguments: everything after `--`)."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", choices=("local", "sdpa"), required=True, help="core attention (see above)")
    p.add_argument("--cpu", action="store_true", help="run on a CPU through the test stand-ins (tests only)")
    return p.parse_args(argv[:split]), argv[split + 1:]


def install_cpu_standins() -> None:
    """What lets Megatron's GPU-only code run on a CPU: the fixtures' stand-ins, and the few CUDA calls of
    Megatron's start-up and logging that they do not cover (this process is the only one, gloo its backend)."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "megatron"))
    import cpu_standins

    cpu_standins.install()
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.reset_peak_memory_stats = cuda.empty_cache = lambda *a, **k: None
    cuda.memory_reserved = cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (1 << 34, 1 << 34)


def sdpa_attention_class():
    """DotProductAttention with torch's fused attention: its constructor (head counts, scale) kept, its forward
    one scaled_dot_product_attention call (causal, grouped key/value heads as they come)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("the SDPA attention of tools/peers/megatron_driver.py takes neither attention "
                                 "biases nor packed sequences")
            # Megatron's [sequence, batch, heads, head size] -> torch's [batch, heads, sequence, head size]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.size(1) != q.size(1))
            return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    return SDPAAttention


def model_provider(attention: str):
    """Megatron's model provider: its GPTModel from the local layer spec, the core attention `attention`."""

    def provide(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        config = config or core_transformer_config_from_args(args)
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
        if attention == "sdpa":
            spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                         post_process=post_process, parallel_output=True,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                         rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                         vp_stage=vp_stage, pg_collection=pg_collection)
        print(f"peer-model parameters={sum(p.numel() for p in model.parameters())} "
              f"vocabulary={args.padded_vocab_size}", flush=True)
        return model

    return provide


class RandomTokens(torch.utils.data.Dataset):
    """`samples` samples of seq + 1 random tokens, each drawn from its index (the same on every run)."""

    def __init__(self, samples: int, seq: int, vocab: int):
        self.samples, self.seq, self.vocab = samples, seq, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.seq + 1,), generator=torch.Generator().manual_seed(index))
        return {"tokens": tokens[:-1], "labels": tokens[1:]}


def datasets_provider(train_val_test_num_samples):
    from megatron.training import get_args

    args = get_args()
    return RandomTokens(train_val_test_num_samples[0], args.seq_length, args.vocab_size), None, None


def forward_step(data_iterator, model):
    """One micro batch: Megatron's GPT forward with labels (per-token losses), their sum over the token count as
    the loss, in the form Megatron's schedules reduce (loss, token count, logged values)."""
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    losses = model(tokens, positions, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().sum()
        count = torch.tensor(output_tensor.numel(), dtype=torch.int, device=loss.device)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return losses, loss_func


def timed(train_step, tokens_per_step):
    """Megatron's train_step, timed between device synchronizations; prints a `peer-step` line per step."""

    def step(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = train_step(*args, **kwargs)
        torch.cuda.synchronize()
        seconds, peak = time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30
        print(f"peer-step {seconds:.6f} {tokens_per_step()} {peak:.3f}", flush=True)
        return result

    return step


def main(argv: list[str]) -> None:
    options, megatron_argv = parse_args(argv)
    if options.cpu:
        install_cpu_standins()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = [sys.argv[0], *megatron_argv]
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.enums import ModelType
    from megatron.training import get_args, training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    dataset_utils.compile_helpers = lambda: None  # the C++ index helpers: unused with RandomTokens
    if options.cpu:
        from cpu_standins import patch_megatron

        patch_megatron()
    parse_and_validate_args()
    args = get_args()
    training.train_step = timed(training.train_step, lambda: args.global_batch_size * args.seq_length)
    training.pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                      forward_step, model_provider=model_provider(options.attention))


if __name__ == "__main__":
    main(sys.argv[1:])
