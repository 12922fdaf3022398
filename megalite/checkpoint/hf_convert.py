"""Whole-checkpoint conversion between megalite and Hugging Face model directories.

`megalite_to_hf` turns a checkpoint saved at any parallel layout into a directory that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load as they load a
released model; `hf_to_megalite` turns such a directory (or a GGUF file transformers can read)
into a weights-only checkpoint that `pretrain_gpt.py --checkpoint.load` resumes at any layout.
gpt-oss's hub checkpoints hold their experts in MXFP4 (`*_blocks`: two E2M1 values a byte, low nibble first;
`*_scales`: one UE8M0 exponent per 32 inputs): transformers' own MXFP4 reader dequantises them at import, exactly
(every E2M1 value times a power of two is an fp32 number), whatever kernels the machine has. DeepSeek-V3's and Kimi
K2's hold their linear weights in FP8 E4M3 with an fp32 scale per 128 x 128 block (`weight_scale_inv`): transformers'
FP8 reader dequantises them at import to the fp32 products DeepSeek's own dequantisation computes.
Configs are hf_config.py's and hf_config_read.py's business, tensor names and layouts hf_mapping.py's; this
module deals with files.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from megalite.checkpoint.files import readable_as_umask
from megalite.checkpoint.hf_config import hf_config
from megalite.checkpoint.hf_config_read import model_config_from_hf
from megalite.checkpoint.hf_deepseek import MODEL_TYPES as DEEPSEEK_TYPES
from megalite.checkpoint.hf_deepseek import hub_config
from megalite.checkpoint.hf_mapping import from_hf, to_hf
from megalite.checkpoint.hf_mtp import hub_mtp_depths, mtp_from_hub, mtp_to_hub, read_hub_mtp, write_hub_mtp
from megalite.checkpoint.hf_tokenizer import has_tokenizer, hf_tokenizer, keep_tokenizer, save_tokenizer
from megalite.checkpoint.model_io import fresh_target, read_model_tensors, write_model_checkpoint
from megalite.config import Config, DataConfig
from megalite.data.tiktoken_dir import load_pretrained_tokenizer


def megalite_to_hf(load: str | Path, save: str | Path, max_shard_size: str = "2GB", drop_mtp: bool = False) -> Path:
    """Write the HF directory of a megalite checkpoint (root or iter_* directory); returns `save`.

    Multi-token prediction's depths are written as DeepseekV3's hub layers after the main ones (hf_mtp.py); an
    architecture without such layers refuses a model with them (hf_config.check_hf_features) unless `drop_mtp`,
    which writes the main model alone and warns that the MTP weights are left out.

    The model is built on the meta device and takes the checkpoint's tensors as they are, so
    converting costs no random initialisation and no second copy of the weights. Files go to a
    temporary sibling directory renamed at the end, so an interrupted conversion leaves nothing
    that looks complete.
    """
    from transformers import AutoModelForCausalLM

    save = fresh_target(save)
    cfg, tensors = read_model_tensors(load)
    if drop_mtp and cfg.model.mtp_num_layers:
        warnings.warn(f"{load}: model.mtp_num_layers={cfg.model.mtp_num_layers}: its multi-token prediction weights "
                      "are not written (drop_mtp / --drop-mtp); the main model is", stacklevel=2)
        cfg.model.mtp_num_layers = 0
    tokenizer = hf_tokenizer(cfg.data, cfg.model.vocab_size, f"{load} (config.yaml)")
    ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model, **ids), dtype=torch.float32)
    result = model.load_state_dict(to_hf(tensors, cfg.model), strict=False, assign=True)
    tied = {"lm_head.weight"} if cfg.model.tied else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"{load}: the {type(model).__name__} built from its config does not match its tensors: "
                         f"missing {sorted(set(result.missing_keys) - tied)}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    model.tie_weights()
    tmp = save.with_name(save.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    if cfg.model.mtp_num_layers:  # transformers' model holds no MTP layers: they go in a file of their own
        write_hub_mtp(tmp, mtp_to_hub(tensors, cfg.model))
    for weights in tmp.glob("*.safetensors"):
        readable_as_umask(weights)
    if tokenizer is not None:
        save_tokenizer(tokenizer, cfg.data, tmp)
    if save.exists():
        save.rmdir()  # empty, checked above
    tmp.rename(save)
    return save


def load_hf(source: str | Path):
    """(fp32 model, tokenizer or None) from an HF model directory or a .gguf file (dequantised by transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"--load {source} does not exist; give a Hugging Face model directory or a .gguf file")
    gguf = {"gguf_file": source.name} if source.suffix == ".gguf" else {}
    directory = source.parent if gguf else source
    if not gguf and not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json, so it is not a Hugging Face model directory")
    quantized = {} if gguf else _dequantized(directory)
    kimi = {} if gguf or hub_config(directory) is None else {"config": hub_config(directory)}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True, **gguf,
                                                 **quantized, **kimi)
    if gguf:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, **gguf)
    else:  # a tiktoken tokenizer (Kimi K2, Moonlight) without its remote code
        tokenizer = load_pretrained_tokenizer(directory) if has_tokenizer(directory) else None
    return model, tokenizer


def _dequantized(directory: Path) -> dict:
    """from_pretrained's arguments that dequantise the checkpoint's quantized weights to the loading dtype: MXFP4
    (gpt-oss's experts) and FP8 E4M3 with a scale per 128 x 128 block (`weight_scale_inv`, as DeepSeek-V3 and
    Kimi K2 are published: each weight is its FP8 value times its block's fp32 scale, the product in fp32, as
    DeepSeek's own dequantisation computes it); refuses other quantizations."""
    from transformers import FineGrainedFP8Config, Mxfp4Config

    quantization = json.loads((directory / "config.json").read_text()).get("quantization_config")
    if quantization is None:
        return {}
    method, blocks = quantization.get("quant_method"), quantization.get("weight_block_size")
    if method == "fp8" and blocks is not None and quantization.get("fmt", "e4m3") == "e4m3":
        return {"quantization_config": FineGrainedFP8Config(weight_block_size=tuple(blocks), dequantize=True)}
    if method != "mxfp4":
        raise ValueError(f"{directory / 'config.json'}: quantization_config.quant_method={method!r}; megalite imports "
                         "MXFP4 weights (gpt-oss), FP8 E4M3 ones with block scales (weight_block_size: DeepSeek-V3, "
                         "Kimi K2) and unquantized ones: dequantise the model first")
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def hf_to_megalite(load: str | Path, save: str | Path, make_vocab_size_divisible_by: int = 128) -> Path:
    """Write a weights-only megalite checkpoint of an HF model directory or .gguf file (see
    hf_model_to_megalite); returns the iteration directory."""
    fresh_target(save)  # before the (slow) load
    model, tokenizer = load_hf(load)
    directory = None if Path(load).suffix == ".gguf" else Path(load)
    hub_mtp = {} if directory is None else _hub_mtp(directory, model.config)
    return hf_model_to_megalite(model, tokenizer, save, f"{load} (config.json)", make_vocab_size_divisible_by,
                                directory, hub_mtp)


def _hub_mtp(directory: Path, hf) -> dict[str, torch.Tensor]:
    """The tensors of a DeepseekV3 directory's layers after the main ones (its multi-token prediction layers, which
    transformers does not load), dequantised as _dequantized's FP8 weights are; {} for other models."""
    if hf.model_type not in DEEPSEEK_TYPES:
        return {}
    quantization = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    block = quantization.get("weight_block_size") if quantization.get("quant_method") == "fp8" else None
    return read_hub_mtp(directory, hf.num_hidden_layers, tuple(block) if block else None)


def hf_model_to_megalite(model, tokenizer, save: str | Path, source: str, make_vocab_size_divisible_by: int = 128,
                         tokenizer_dir: Path | None = None, hub_mtp: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a weights-only megalite checkpoint of a loaded transformers model (hf_config.ARCHITECTURES), with its
    tokenizer (if any) under save/tokenizer (the files of HF directory `tokenizer_dir` unchanged, when given);
    returns the iteration directory, whose config.yaml holds the derived model config and names the tokenizer.
    `source` names the model in errors; `hub_mtp`: the hub's multi-token prediction layers (hf_mtp.py), which
    become model.mtp_num_layers depths."""
    save = fresh_target(save)
    cfg = Config(model=model_config_from_hf(model.config, source))
    cfg.model.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    hf_state = model.state_dict()
    interleaved = bool(getattr(model.config, "rope_interleave", False))
    tensors = from_hf(hf_state, cfg.model, interleaved)
    hub_mtp = hub_mtp or {}
    declared = getattr(model.config, "num_mtp_layers", 0) or 0
    cfg.model.mtp_num_layers = hub_mtp_depths(hub_mtp, cfg.model.num_layers, declared)
    tensors |= mtp_from_hub(hub_mtp, tensors, cfg.model, interleaved, source)
    tied = {"lm_head.weight"} if cfg.model.tied else set()
    unused = set(hf_state) - set(to_hf(tensors, cfg.model)) - tied
    unused |= set(hub_mtp) - set(mtp_to_hub(tensors, cfg.model))
    if unused:
        raise ValueError(f"{source}: tensors {sorted(unused)} have no place in megalite's {cfg.model.family}; "
                         "this model cannot be converted")
    save.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        cfg.data = DataConfig(**keep_tokenizer(tokenizer, save, tokenizer_dir))
    return write_model_checkpoint(save, cfg, tensors)
