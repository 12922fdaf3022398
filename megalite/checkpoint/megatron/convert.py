"""A Megatron-LM checkpoint (legacy or torch_dist, any tp/pp) as a megalite checkpoint that resumes the run.

The weights (the optimizer's fp32 main weights where the checkpoint has them), Adam's moments and step, the
iteration and `args.consumed_train_samples` carry over, so `pretrain_gpt.py --checkpoint.load` continues at
the same step, learning rate and data position with the same optimizer state, at any megalite layout. The
model config comes from Megatron's args (args.py), its data section too (data_args.py: the same blend, split,
seed and size under data.blend_rule=megatron, so the run trains on Megatron's next samples), with a report of
what was carried and what the user must check. Every tensor must find its place in megalite's model and
every megalite parameter its tensor, at the shape megalite builds: anything else stops, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megalite.checkpoint.megatron.args import config_from_args
from megalite.checkpoint.megatron.data_args import DataCarry
from megalite.checkpoint.megatron.formats import read_megatron
from megalite.checkpoint.megatron.mla import to_megalite_layout
from megalite.checkpoint.megatron.names import BUFFER, megalite_name
from megalite.checkpoint.megatron.state import MAIN, MOMENTS, MegatronState
from megalite.checkpoint.model_io import fresh_target, write_model_checkpoint
from megalite.config import Config, ModelConfig
from megalite.model.gpt import GPTModel

Tensors = dict[str, torch.Tensor]


def megalite_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameters (and checkpointed buffers: a router's expert bias) megalite builds for `cfg`, with their
    one-device shapes (built on the meta device)."""
    model = GPTModel(cfg, torch.device("meta"), seed=0)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def _weights(state: MegatronState, cfg: Config) -> tuple[Tensors, dict[str, str]]:
    """megalite's tensors (fp32; the main weights where saved), and which Megatron name each came from."""
    tensors, source = {}, {}
    for name, tensor in state.weights.items():
        ours = megalite_name(name, cfg.model.tied, str(state.path), cfg.model.multi_latent_attention)
        if ours is None:
            continue
        if ours in tensors:
            raise ValueError(f"{state.path}: {name} and {source[ours]} both map to megalite's {ours}")
        tensors[ours] = to_megalite_layout(ours, state.optimizer.get(name, {}).get(MAIN, tensor).float(), cfg.model)
        source[ours] = name
    expected = megalite_shapes(cfg.model)
    missing = sorted(expected.keys() - tensors.keys())
    wrong = [f"{source[n]} {tuple(t.shape)} (megalite's {n} is {expected[n]})" for n, t in tensors.items()
             if n in expected and tuple(t.shape) != expected[n]]
    if missing or wrong:
        raise ValueError(f"{state.path}: the checkpoint does not fit the model its args describe: missing "
                         f"{missing}, shapes {wrong}")
    return tensors, source


def _adam_state(state: MegatronState, source: dict[str, str], cfg: ModelConfig) -> dict[str, Tensors]:
    """Adam's moments and step per megalite parameter; empty where the checkpoint has no optimizer state."""
    if not state.optimizer:
        return {}
    if state.adam_step is None:
        raise ValueError(f"{state.path}: optimizer state without Adam's step; convert with --no-optimizer")
    out = {}
    for ours, theirs in source.items():
        if theirs.endswith(BUFFER):
            continue
        kinds = state.optimizer.get(theirs, {})
        missing = [kind for kind in MOMENTS if kind not in kinds]
        if missing:
            raise ValueError(f"{state.path}: no optimizer {', '.join(missing)} for {theirs}; convert with "
                             "--no-optimizer to carry the weights only")
        out[ours] = {kind: to_megalite_layout(ours, kinds[kind].float(), cfg) for kind in MOMENTS}
        out[ours]["step"] = torch.tensor([float(state.adam_step)])
    return out


@dataclass
class Converted:
    """The iteration directory written; what the data section carried and what to check (lines to print); what
    the launch command must add."""

    path: Path
    report: list[str]
    flags: list[str]


def megatron_to_megalite(load: str | Path, save: str | Path, with_optimizer: bool = True) -> Converted:
    """Write the megalite checkpoint of a Megatron-LM checkpoint (its root or one iteration directory)."""
    save = fresh_target(save)
    configs: list[tuple[Config, DataCarry]] = []
    state = read_megatron(load, lambda args: configs.append(config_from_args(args, str(load))), with_optimizer)
    cfg, carry = configs[0]
    tensors, source = _weights(state, cfg)
    optimizer = _adam_state(state, source, cfg.model)
    consumed = int(getattr(state.args, "consumed_train_samples", 0) or 0)
    path = write_model_checkpoint(save, cfg, tensors, state.iteration, consumed, optimizer)
    return Converted(path, carry.lines(consumed), carry.flags)
