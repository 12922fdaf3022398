"""train.compile: each transformer layer compiled (regional compilation, as torchtitan does), composed with
tensor and sequence parallelism, pipeline parallelism (ZB-V too: its split backward runs through an opaque
op, parallel/weight_grads.py; DualPipeV's F&B pairs and whole backwards beside split ones), activation
recompute (selective's checkpoint runs eager inside the compiled layer, with latent attention's up-projections),
multi-token prediction's layers (compiled as the main ones are), FP8 matmuls (tensorwise, its scales agreed
over tp) and the data-parallel hooks
(the distributed optimizer's overlapped gathers wait in module pre-hooks; ZeRO-3 gathers and frees each
layer around its forward). Inductor runs on the CPU, so the compiled losses are compared with eager ones."""

from __future__ import annotations

import os

import pytest
from distributed import run_ranks

from megalite.config_cli import parse_config
from megalite.parallel.topology import Topology, release_process_groups
from megalite.training.build import build_rank_model
from megalite.training.pretrain import pretrain

BASE = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4", "--model.seq_length=32",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.global_batch_size=4", "--train.train_iters=3",
        "--optim.clip_grad=0.5", "--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true",
        "--data.num_workers=0", "--train.device=cpu"]


def _eager_and_compiled(rank: int, world_size: int, layout: list[str]) -> tuple[list[float], list[float]]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    runs = [pretrain(parse_config([*BASE, *layout, f"--train.compile={flag}"])).losses for flag in ("false", "true")]
    return tuple(list(losses.values()) for losses in runs)


@pytest.mark.parametrize("layout", [
    ["--model.family=llama", "--model.num_query_groups=2", "--parallel.tp=2", "--parallel.sequence_parallel=true",
     "--train.recompute=full"],
    ["--model.family=gpt2", "--parallel.pp=2"],
    ["--model.family=gpt2", "--parallel.distributed_optimizer=true", "--parallel.overlap_param_gather=true"],
    ["--model.family=llama", "--model.num_query_groups=2", "--parallel.zero_stage=3"],
    ["--model.family=llama", "--model.num_experts=4", "--model.moe_ffn_hidden_size=32", "--parallel.ep=2",
     "--model.moe_aux_loss_coeff=0.01"],
    ["--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=4", "--parallel.pp=2",
     "--parallel.vp=2", "--parallel.pipeline_schedule=zb-v", "--train.recompute=full"],
    ["--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=4", "--model.num_experts=4",
     "--model.moe_ffn_hidden_size=32", "--parallel.pp=2", "--parallel.vp=2", "--parallel.pipeline_schedule=dualpipev",
     "--train.recompute=full"],
    ["--model.family=llama", "--model.num_query_groups=null", "--model.mtp_num_layers=1", "--parallel.tp=2",
     "--parallel.sequence_parallel=true", "--model.multi_latent_attention=true", "--model.q_lora_rank=16",
     "--model.kv_lora_rank=16", "--model.qk_head_dim=8", "--model.qk_pos_emb_head_dim=8", "--model.v_head_dim=8",
     "--train.recompute=selective", "--train.fp8_recipe=tensorwise"],
])
def test_compiled_layers_train_like_eager(layout):
    """Inductor fuses the layers' elementwise work and may reorder float sums, so compiled and eager steps
    agree to fp32 rounding carried through three steps (1e-5 relative; identical on most runs here)."""
    for eager, compiled in run_ranks(2, _eager_and_compiled, layout):
        assert compiled == pytest.approx(eager, rel=1e-5)


def test_multi_token_prediction_layers_are_compiled_with_the_main_ones():
    cfg = parse_config([*BASE, "--model.family=llama", "--model.num_query_groups=2", "--model.mtp_num_layers=1",
                        "--train.compile=true"])
    topology = Topology.from_environment("cpu", cfg.parallel, False)
    try:
        layers = build_rank_model(cfg, topology).transformer_layers()
    finally:
        release_process_groups()
    assert len(layers) == 3 and all(layer._compiled_call_impl is not None for layer in layers)
