"""DeepSeek-V3-class models as released (DeepSeek-V3/R1, Kimi K2, Moonlight).

- Routing equals transformers' DeepseekV3TopkRouter: sigmoid scores, the expert bias choosing only, group-limited
  selection by the sum of each group's two best scores (model.moe_router_group_experts=2; the default, Megatron's
  k / group_topk, chooses other groups where k != 2 x topk_group), renormalised, times routed_scaling_factor.
- A tiny random DeepseekV3ForCausalLM (YaRN, interleaved rotary rows, group-limited routing, a dense first layer,
  a shared expert, expert biases), with and without query compression, converts in (tools/convert_checkpoint.py)
  with transformers' logits, and out to the very tensors it came from (experts one by one, as the hub stores
  them), which transformers loads with no missing or unexpected weights and megalite's logits; experts fused as
  transformers v5 holds them convert as the hub's one by one do; so does Kimi K2's `model_type: kimi_k2` directory,
  read without its remote code.
- The hub's MTP layer (layer num_hidden_layers: experts one by one, `shared_head.norm`, copies of the embedding
  and head), which transformers skips, converts into megalite's MTP with the depth's loss computed by hand with
  transformers' modules on the hub tensors, and back out with every tensor bit for bit and num_nextn_predict_layers;
  the converted model decodes greedily through the latent cache as transformers does;
  published in FP8, it comes in dequantised; an incomplete one, one whose embedding or head copy differs from the
  shared one, or a layer past num_nextn_predict_layers is refused by name.
- Its published FP8 layout (E4M3 weights, an fp32 `weight_scale_inv` per 128 x 128 block) converts to exactly the
  checkpoint of the model holding the dequantised values (each FP8 value times its block's scale, in fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_models import spread_routers_and_norms
from safetensors.torch import load_file, save_file
from test_hf_convert import _same_logits, convert, hf_tensors
from transformers import DeepseekV3Config
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

from megalite.checkpoint.hf_convert import hf_model_to_megalite
from megalite.config import ModelConfig
from megalite.data.mtp_targets import mtp_targets
from megalite.inference.generate import Sampling, generate, load_model
from megalite.model.moe.router import route


def test_released_group_routing_equals_transformers_router():
    """k 6 of 16 experts in 4 groups, the best 2 groups: Megatron's group score (best 3) differs from the released
    one (best 2) for some tokens."""
    hf_cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=6, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.3, generator=gen)
    x = torch.randn(64, 16, generator=gen)
    _, hf_weights, hf_experts = router(x)
    cfg = ModelConfig(family="llama", num_experts=16, moe_topk=6, moe_router="sigmoid", moe_router_groups=4,
                      moe_router_group_topk=2, moe_scaling_factor=2.5, moe_norm_topk_prob=True,
                      moe_router_group_experts=2)
    logits = x @ router.weight.t()
    ours = route(logits, cfg, router.e_score_correction_bias)
    order, hf_order = ours.experts.argsort(-1), hf_experts.argsort(-1)
    assert torch.equal(ours.experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(ours.weights.gather(1, order), hf_weights.gather(1, hf_order))
    cfg.moe_router_group_experts = None  # Megatron-Core's rule: some tokens choose other experts
    assert not torch.equal(route(logits, cfg, router.e_score_correction_bias).experts.sort(-1).values,
                           hf_experts.sort(-1).values)


# ------------------------------------------------------------------------------ Hugging Face both ways

def _tiny_deepseek(q_lora: int | None, rms_norm_eps: float = 1e-6) -> transformers.PreTrainedModel:
    """A tiny random DeepseekV3ForCausalLM: YaRN, interleaved rotary rows, group-limited routing (3 of 8 experts
    in the best 2 of 4 groups: Megatron's group score would differ), a dense first layer, a shared expert, random
    expert biases. `rms_norm_eps`: the layers' and final norms' (the latents' are 1e-6 whatever it is, as
    DeepSeek's code has them)."""
    config = transformers.DeepseekV3Config(
        vocab_size=250, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=q_lora,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
        rope_interleave=True, initializer_range=0.1, bos_token_id=None, eos_token_id=248, rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    spread_routers_and_norms(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    return model


@pytest.mark.parametrize(("q_lora", "rms_norm_eps"), [(12, 1e-6), (None, 1e-6), (None, 1e-2)],
                         ids=["query compression", "none", "none, Moonlight's two epsilons (exaggerated)"])
def test_deepseek_v3_converts_in_with_transformers_logits_and_back_bit_for_bit(q_lora, rms_norm_eps, tmp_path):
    hf_in = _tiny_deepseek(q_lora, rms_norm_eps)
    hf_in.save_pretrained(tmp_path / "hf_in")  # the hub's layout: experts one by one
    convert("--from-hf", "--load", str(tmp_path / "hf_in"), "--save", str(tmp_path / "megalite"))
    model, cfg, _ = load_model(tmp_path / "megalite", torch.device("cpu"))
    assert cfg.model.multi_latent_attention and cfg.model.moe_router_group_experts == 2
    tokens = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    _same_logits(f"deepseek_v3 q_lora {q_lora}", model, hf_in, tokens)
    convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / "hf_back"))
    before, after = hf_tensors(tmp_path / "hf_in"), hf_tensors(tmp_path / "hf_back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    hf_back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_back", output_loading_info=True)
    assert type(hf_back).__name__ == "DeepseekV3ForCausalLM" and hf_back.config.rope_interleave
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    _same_logits("deepseek_v3 back", model, hf_back.eval(), tokens)


def test_a_kimi_k2_directory_converts_in_without_remote_code(tmp_path):
    """Kimi K2's config.json (`model_type: kimi_k2`, its `auto_map` naming code megalite never runs, which is not
    even there; YaRN as `rope_scaling` with beta_fast = beta_slow = 1 over an original context of 4,096, where
    beta_fast = 32 would interpolate another rotary channel) over DeepseekV3's tensors converts in with the logits
    of transformers' DeepseekV3 of those fields, and back as DeepseekV3ForCausalLM."""
    _tiny_deepseek(12).save_pretrained(tmp_path / "kimi")
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    config.pop("rope_parameters")
    config |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "rope_theta": 10000.0,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                                "mscale_all_dim": 0.8, "original_max_position_embeddings": 4096},
               "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(config))
    fields = {k: v for k, v in config.items() if k not in ("model_type", "auto_map")}
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "kimi",
                                                           config=DeepseekV3Config.from_dict(fields)).eval()
    assert hf.config.rope_parameters["beta_fast"] == hf.config.rope_parameters["beta_slow"] == 1.0
    convert("--from-hf", "--load", str(tmp_path / "kimi"), "--save", str(tmp_path / "megalite"))
    model, cfg, _ = load_model(tmp_path / "megalite", torch.device("cpu"))
    assert cfg.model.multi_latent_attention and (cfg.model.rope_beta_fast, cfg.model.rope_beta_slow) == (1.0, 1.0)
    _same_logits("kimi_k2", model, hf, torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0)))
    convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / "back"))
    before, after = hf_tensors(tmp_path / "kimi"), hf_tensors(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "deepseek_v3"


def test_experts_fused_as_transformers_holds_them_convert_as_the_hubs_one_by_one(tmp_path):
    """A directory holding transformers v5's fused experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`) as
    written from its state dict converts to exactly the checkpoint of the hub's layout (experts one by one)."""
    hf = _tiny_deepseek(12)
    hf.save_pretrained(tmp_path / "hub")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "mlp.experts.0." not in "".join(state)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in hf_tensors(tmp_path / "hub")
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    for name in ("hub", "fused"):
        convert("--from-hf", "--load", str(tmp_path / name), "--save", str(tmp_path / f"{name}_in"))
    got, expected = (load_model(tmp_path / f"{name}_in", torch.device("cpu"))[0].state_dict()
                     for name in ("fused", "hub"))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def _block_fp8(directory: Path) -> dict[str, torch.Tensor]:
    """Rewrite the linear weights of the HF directory as DeepSeek publishes them, FP8 E4M3 with an fp32 scale per
    128 x 128 block (`weight_scale_inv`, amax / 448); returns what each dequantises to, by name."""
    dequantised = {}
    for file in directory.glob("*.safetensors"):
        state, out = load_file(file), {}
        for name, w in state.items():
            if w.dim() != 2 or not name.endswith(("proj.weight", "proj_with_mqa.weight")):
                out[name] = w
                continue
            assert w.shape[0] < 128 and w.shape[1] < 128  # one (partial) block each, at this size
            scale = w.abs().max().reshape(1, 1) / 448
            out[name] = (w / scale).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale
            dequantised[name] = out[name].float() * scale
        save_file(out, file, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    (directory / "config.json").write_text(json.dumps(config))
    return dequantised


def test_block_fp8_weights_dequantise_exactly_at_import(tmp_path):
    """The published FP8 layout converts to the checkpoint of the same model holding the dequantised values."""
    _tiny_deepseek(12).save_pretrained(tmp_path / "fp8")
    dequantised = _block_fp8(tmp_path / "fp8")
    reference = _tiny_deepseek(12)
    with torch.no_grad():
        for name, value in dequantised.items():
            if name in dict(reference.named_parameters()):
                reference.get_parameter(name).copy_(value)
            else:  # an expert: transformers holds them fused ([E, 2I, H] gate then up; [E, H, I])
                layer, expert, kind = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
                fused = reference.get_parameter(f"{layer}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}")
                rows = slice(None) if kind == "down_proj" else slice(0, 16) if kind == "gate_proj" else slice(16, 32)
                fused[expert, rows] = value
    reference.save_pretrained(tmp_path / "reference")
    for name in ("fp8", "reference"):
        convert("--from-hf", "--load", str(tmp_path / name), "--save", str(tmp_path / f"{name}_in"))
    got, expected = (load_model(tmp_path / f"{name}_in", torch.device("cpu"))[0].state_dict()
                     for name in ("fp8", "reference"))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    unquantised = _tiny_deepseek(12).state_dict()
    assert all(not torch.equal(value, unquantised[name]) for name, value in dequantised.items()
               if name in unquantised)  # FP8 rounded every weight it holds


# ------------------------------------------------------------------------------ the hub's MTP layer

def _hub_mtp_layer(hf: transformers.PreTrainedModel) -> tuple[MtpLayer, dict[str, torch.Tensor]]:
    """A random MTP layer of transformers' kind (MoE: layer num_hidden_layers is past first_k_dense_replace) and
    its tensors as DeepSeek's hub stores them: `model.layers.{num_hidden_layers}.*`, experts one by one, the final
    norm as `shared_head.norm`, with copies of the embedding and the head."""
    config, n = hf.config, hf.config.num_hidden_layers
    layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, n).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen) if "norm" in name
                    else 0.15 * torch.randn(t.shape, generator=gen))
    hub, prefix = {}, f"model.layers.{n}."
    for name, t in layer.state_dict().items():
        name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            for e, expert in enumerate(t):
                gate, up = expert.chunk(2)
                hub |= {f"{prefix}mlp.experts.{e}.{part}_proj.weight": w for part, w in (("gate", gate), ("up", up))}
        elif name.endswith("experts.down_proj"):
            hub |= {f"{prefix}mlp.experts.{e}.down_proj.weight": expert for e, expert in enumerate(t)}
        else:
            hub[prefix + name] = t
    hub[prefix + "embed_tokens.weight"] = hf.model.embed_tokens.weight
    hub[prefix + "shared_head.head.weight"] = hf.lm_head.weight
    return layer, {k: v.detach().clone().contiguous() for k, v in hub.items()}


def _depth_1_loss_by_hand(hf, layer: MtpLayer, tokens: torch.Tensor) -> float:
    """The summed cross-entropy of the MTP layer computed with transformers' modules on the hub tensors: at
    position i, [enorm(Emb(t_{i+1})); hnorm(h_i)] through eh_proj, the decoder layer and shared_head.norm, scored
    by the head against t_{i+2} (h: the main model's normed output)."""
    seq = tokens.shape[1] - 1
    with torch.no_grad():
        hidden = hf.model(tokens[:, :seq]).last_hidden_state
        embedded = hf.model.embed_tokens(tokens[:, 1:])
        positions = torch.arange(seq)[None]
        causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = layer(embedded, hidden, position_embeddings=hf.model.rotary_emb(embedded, positions),
                    attention_mask=causal, position_ids=positions, cache=None)
        logits = hf.lm_head(out)[:, : seq - 1]
    return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten(), reduction="sum"))


def test_hub_mtp_layer_converts_in_with_its_loss_and_back_bit_for_bit(tmp_path):
    hf_in = _tiny_deepseek(12)
    hf_in.save_pretrained(tmp_path / "hub")
    layer, mtp = _hub_mtp_layer(hf_in)
    (weights,) = (tmp_path / "hub").glob("*.safetensors")
    save_file(load_file(weights) | mtp, weights, metadata={"format": "pt"})
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    convert("--from-hf", "--load", str(tmp_path / "hub"), "--save", str(tmp_path / "megalite"))
    model, cfg, _ = load_model(tmp_path / "megalite", torch.device("cpu"))
    assert cfg.model.mtp_num_layers == 1
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))
    labels = tokens[:, 1:]
    model.aux_losses.start_step(1.0, torch.device("cpu"))
    with torch.no_grad():
        model(tokens[:, :-1], labels, None, mtp=mtp_targets(labels, torch.ones(labels.shape), None, 1))
    assert float(model.aux_losses.totals["mtp_1"]) == pytest.approx(_depth_1_loss_by_hand(hf_in, layer, tokens),
                                                                    rel=1e-5)
    before = hf_tensors(tmp_path / "hub")
    for shards, save in (("2GB", "hub_back"), ("100KB", "hub_sharded")):  # one file, or shards with their index
        convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / save),
                "--max-shard-size", shards)
        after = hf_tensors(tmp_path / save)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        index = json.loads((tmp_path / save / "model.safetensors.index.json").read_text())["weight_map"]
        assert index.keys() == before.keys()
    assert len(list((tmp_path / "hub_sharded").glob("*.safetensors"))) > 2
    assert json.loads((tmp_path / "hub_back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hub_back", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"]  # transformers skips the MTP layer alone
    assert all(name.startswith("model.layers.2.") for name in info["unexpected_keys"])


def test_greedy_generation_through_the_latent_cache_equals_transformers(tmp_path):
    """A converted DeepSeek-V3 with its hub MTP layer (which generation leaves out) decodes greedily through the
    latent cache, 42 positions past YaRN's original 16, as it does without the cache and as transformers does."""
    hf = _tiny_deepseek(12)
    hf.save_pretrained(tmp_path / "hub")
    (weights,) = (tmp_path / "hub").glob("*.safetensors")
    save_file(load_file(weights) | _hub_mtp_layer(hf)[1], weights, metadata={"format": "pt"})
    convert("--from-hf", "--load", str(tmp_path / "hub"), "--save", str(tmp_path / "megalite"))
    model, cfg, _ = load_model(tmp_path / "megalite", torch.device("cpu"))
    assert cfg.model.mtp_num_layers == 1
    prompt = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    cached = generate(model, prompt, Sampling(max_new_tokens=30, temperature=0, stop_tokens=()))
    assert cached == generate(model, prompt, Sampling(max_new_tokens=30, temperature=0, stop_tokens=(),
                                                      use_cache=False))
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert cached == theirs[0, len(prompt):].tolist() and len(set(cached)) > 5


def test_hub_mtp_layer_in_block_fp8_dequantises_at_import(tmp_path):
    """The MTP layer as published in FP8 comes in as its dequantised values: written back, each FP8 weight is its
    value times its block's scale, every other tensor as it was."""
    hf = _tiny_deepseek(12)
    hf.save_pretrained(tmp_path / "fp8")
    _, mtp = _hub_mtp_layer(hf)
    (weights,) = (tmp_path / "fp8").glob("*.safetensors")
    save_file(load_file(weights) | mtp, weights, metadata={"format": "pt"})
    dequantised = _block_fp8(tmp_path / "fp8")
    convert("--from-hf", "--load", str(tmp_path / "fp8"), "--save", str(tmp_path / "megalite"))
    convert("--to-hf", "--load", str(tmp_path / "megalite"), "--save", str(tmp_path / "back"))
    back = hf_tensors(tmp_path / "back")
    assert any(name in dequantised for name in mtp)
    assert all(torch.equal(back[name], dequantised.get(name, value)) for name, value in mtp.items())


def test_a_hub_mtp_layer_megalite_cannot_hold_is_refused_by_name(tmp_path):
    hf = _tiny_deepseek(12)
    _, mtp = _hub_mtp_layer(hf)

    def refused(hub: dict[str, torch.Tensor], save: str) -> str:
        with pytest.raises(ValueError) as error:
            hf_model_to_megalite(hf, None, tmp_path / save, "hub", hub_mtp=hub)
        return str(error.value)

    incomplete = {k: v for k, v in mtp.items() if k != "model.layers.2.eh_proj.weight"}
    assert "model.layers.2.* lacks 'model.layers.2.eh_proj.weight'" in refused(incomplete, "incomplete")
    other_head = mtp | {"model.layers.2.shared_head.head.weight": mtp["model.layers.2.shared_head.head.weight"] + 1}
    assert "model.layers.2.shared_head.head.weight differs from the main model's" in refused(other_head, "head")
    beyond = mtp | {"model.layers.3.enorm.weight": mtp["model.layers.2.enorm.weight"]}  # num_nextn_predict_layers=1
    assert "'model.layers.3.enorm.weight'] have no place" in refused(beyond, "beyond")
