"""gpt-oss as the hub holds it: its experts in MXFP4 (`*_blocks`: two E2M1 values a byte, low nibble first;
`*_scales`: one UE8M0 exponent, biased by 127, per 32 inputs). A tiny gpt-oss written so converts in with every
expert weight the format's exact value (decoded here from the OCP Microscaling spec, not by transformers' reader),
and with the logits transformers computes from the same file, on a sequence longer than its window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_models import random_hf
from safetensors.torch import load_file, save_file
from test_hf_convert import _same_logits, convert

from megalite.checkpoint.model_io import read_model_tensors
from megalite.inference.generate import load_model

EXPERTS = ("gate_up_proj", "down_proj")


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """The value of each 4-bit E2M1 code: sign bit, two exponent bits (bias 1), one mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    sign = 1.0 - 2.0 * ((code >> 3) & 1).float()
    exponent, mantissa = ((code >> 1) & 3).float(), (code & 1).float()
    normal = 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * torch.where(exponent == 0, mantissa / 2, normal)


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, groups, 16] bytes and [..., rows, groups] exponents -> [..., rows, groups * 32] values."""
    pairs = torch.stack((e2m1(blocks & 0x0F), e2m1(blocks >> 4)), dim=-1)  # the low nibble is the first value
    return (pairs.flatten(-2) * 2.0 ** (scales.float() - 127).unsqueeze(-1)).flatten(-2)


def write_mxfp4(model: transformers.PreTrainedModel, directory: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save `model` as the hub's gpt-oss files, its experts' weights replaced by random MXFP4 blocks and scales
    (exponents 2^-6 .. 2^0); returns each expert tensor's exact value, in transformers' layout ([E, in, out])."""
    model.save_pretrained(directory)
    state, values = load_file(directory / "model.safetensors"), {}
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(EXPERTS)]:
        experts, inputs, outputs = state.pop(name).shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(121, 128, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=generator)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        values[name] = mxfp4_values(blocks, scales).transpose(1, 2)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return values


def test_e2m1_codes_are_the_specs_values():
    assert e2m1(torch.arange(16)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # low nibble 1 (0.5), high nibble 2 (1.0)
    assert mxfp4_values(blocks, torch.tensor([[129]], dtype=torch.uint8))[0, :3].tolist() == [2.0, 4.0, 0.0]


def test_gpt_oss_mxfp4_experts_dequantise_exactly_at_import(tmp_path):
    hf_dir = tmp_path / "hub"
    values = write_mxfp4(random_hf("gpt_oss"), hf_dir)
    convert("--from-hf", "--load", str(hf_dir), "--save", str(tmp_path / "megalite"))
    cfg, tensors = read_model_tensors(tmp_path / "megalite")
    for layer in range(cfg.model.num_layers):
        hf, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
        gate_up, down = values[f"{hf}gate_up_proj"], values[f"{hf}down_proj"]
        gate_rows = torch.cat((gate_up[:, :, 0::2], gate_up[:, :, 1::2]), dim=2).transpose(1, 2)
        assert torch.equal(tensors[f"{ours}linear_fc1.weight"], gate_rows), layer
        assert torch.equal(tensors[f"{ours}linear_fc2.weight"], down.transpose(1, 2)), layer
    hub = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    model, _, _ = load_model(tmp_path / "megalite", torch.device("cpu"))
    tokens = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))  # its window is 6
    _same_logits("gpt-oss mxfp4", model, hub, tokens)


def test_other_quantizations_are_refused(tmp_path, capsys):
    random_hf("mistral").save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(SystemExit):
        convert("--from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "out"))
    assert "config.json: quantization_config.quant_method='fp8'; megalite imports MXFP4" in capsys.readouterr().err
