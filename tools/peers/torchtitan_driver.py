"""torchtitan's own trainer (`torchtitan.train`) on synthetic tokens: tools/gpu_check.py's peers step runs it
beside megalite.

    torchrun --standalone --nproc_per_node=1 tools/peers/torchtitan_driver.py --model-args JSON -- TORCHTITAN_ARGS...

torchtitan has no mock data: this registers a train spec, `megalite_peer`, made of torchtitan's own Llama 3
model, parallelization, optimizer, LR schedule and loss, with a dataloader of random tokens and no tokenizer, and
hands it to torchtitan's trainer. JSON holds the model's TransformerModelArgs (dim, n_layers, n_heads, n_kv_heads,
vocab_size, multiple_of, ffn_dim_multiplier, rope_theta; `rope_scaling_factor` sets its RoPE scaling), the
flavor `peer`; TORCHTITAN_ARGS are torchtitan's command line (`--model.name megalite_peer --model.flavor peer`
and the training options). torchtitan imports Hugging Face `datasets` at start-up for its text dataloaders,
which this spec does not use: where `datasets` cannot be imported (absent, or its pyarrow broken), a stand-in
module takes its place that fails if anything calls it.

Each optimizer step prints `peer-step <seconds> <tokens> <peak allocated GiB>` (timed between device
synchronizations; the peak is the step's, kept across the resets torchtitan's metrics make inside the step) and
the built model `peer-model parameters=<count> vocabulary=<size>`, as tools/peers/megatron_driver.py does.
`--cpu` (tests only) runs on a CPU: torchtitan picks CUDA whenever no other accelerator is found, so a small shim
names the CPU as its device, gives torch.cpu the few memory queries torchtitan's metrics ask torch.cuda for, and
stands in for the MoE triton kernels a dense model never runs (a CPU machine has no triton).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
import types
from collections.abc import Callable

import torch

SPEC = "megalite_peer"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this driver's options, torchtitan's arguments: everything after `--`)."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-args", type=json.loads, required=True, help="TransformerModelArgs fields as JSON")
    p.add_argument("--cpu", action="store_true", help="run on a CPU (tests only)")
    return p.parse_args(argv[:split]), argv[split + 1:]


def stand_in_for_datasets() -> None:
    """A `datasets` module whose functions fail when called, where the real one cannot be imported."""
    try:
        importlib.import_module("datasets")
        return
    except Exception as error:  # noqa: BLE001 - absent, or broken by its own dependencies: either way unused here
        reason = f"{type(error).__name__}: {error}"

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"Hugging Face datasets could not be imported ({reason}); the megalite_peer train spec "
                           "reads random tokens and needs none")

    module, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    module.Dataset = module.IterableDataset = type("Dataset", (), {})
    module.load_dataset = unavailable
    module.distributed, distributed.split_dataset_by_node = distributed, unavailable
    sys.modules.update({"datasets": module, "datasets.distributed": distributed})


def cpu_shim() -> None:
    """torchtitan on a CPU: its device type is the CPU's, torch.cpu answers its memory monitor's calls, and its
    MoE triton kernels (imported at start-up, never run by a dense model) are a module that fails if called, as
    is TensorBoard's writer where tensorboard is not installed (the GPU image has it; metrics here do not use it)."""
    import torch._utils

    def triton_only(*args, **kwargs):
        raise RuntimeError("not on a CPU: tools/peers/torchtitan_driver.py --cpu stands in for this")

    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = triton_only
    sys.modules[kernels.__name__] = kernels
    if importlib.util.find_spec("tensorboard") is None:  # the GPU image has it; torchtitan imports its writer
        writer = types.ModuleType("torch.utils.tensorboard")
        writer.SummaryWriter = type("SummaryWriter", (), {"__init__": triton_only})
        sys.modules[writer.__name__] = writer

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.current_device = lambda: 0  # torchtitan passes it to barrier(device_ids=...), which takes indices
    cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=1 << 34, name="cpu")
    cpu.reset_peak_memory_stats = cpu.empty_cache = lambda *a, **k: None
    cpu.memory_stats = lambda *a, **k: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                        "num_alloc_retries": 0, "num_ooms": 0}


def random_tokens_loader(vocab: int):
    """A torchtitan dataloader builder: each batch local_batch_size x (seq_len + 1) random tokens drawn from the
    step's index, the inputs all but the last, the labels all but the first."""
    from torchtitan.components.dataloader import BaseDataLoader

    class RandomTokens(BaseDataLoader):
        def __init__(self, batch: int, seq: int):
            self.batch, self.seq = batch, seq

        def __iter__(self):
            step = 0
            while True:
                generator = torch.Generator().manual_seed(step)
                tokens = torch.randint(0, vocab, (self.batch, self.seq + 1), generator=generator)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]
                step += 1

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    def build(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
        return RandomTokens(job_config.training.local_batch_size, job_config.training.seq_len)

    return build


def register(model_args: dict) -> None:
    """The `megalite_peer` train spec: torchtitan's Llama 3 with these args as flavor `peer`, random tokens."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

    fields = dict(model_args)
    scaling = fields.pop("rope_scaling_factor", None)
    if scaling is not None:
        fields["rope_scaling_args"] = RoPEScalingArgs(scaling_factor=scaling)
    args = TransformerModelArgs(**fields)
    register_train_spec(SPEC, TrainSpec(
        model_cls=Transformer, model_args={"peer": args}, parallelize_fn=parallelize_llama, pipelining_fn=None,
        build_optimizers_fn=build_optimizers, build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=random_tokens_loader(args.vocab_size), build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss))


class PeakAcrossResets:
    """The allocator's peak over a step however often torchtitan resets it. Its metrics processor resets the peak
    after every log (each step at --metrics.log_freq 1), inside train_step: read after the step, the peak was that
    of the memory held between steps (the model and optimizer state: 16 bytes a parameter, 21.3 GiB of 1.42B on
    the H200), not the step's. `wrap` gives the reset to install, which first keeps the peak it is about to lose."""

    def __init__(self, read_peak: Callable[[], int]):
        self.read_peak, self.kept = read_peak, 0

    def wrap(self, reset: Callable[[], None]) -> Callable[[], None]:
        def keep_then_reset() -> None:
            self.kept = max(self.kept, self.read_peak())
            reset()

        return keep_then_reset

    def take(self) -> int:
        """The peak since the last take, resets included."""
        peak, self.kept = max(self.kept, self.read_peak()), 0
        return peak


def allocated_peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def timed_trainer():
    """torchtitan's Trainer, its train_step timed between device synchronizations (a `peer-step` line each, with
    the step's peak of allocated memory)."""
    from torchtitan.tools import utils
    from torchtitan.train import Trainer

    class TimedTrainer(Trainer):
        def __init__(self, job_config):
            super().__init__(job_config)
            parameters = sum(p.numel() for m in self.model_parts for p in m.parameters())
            print(f"peer-model parameters={parameters} vocabulary={self.model_args.vocab_size}", flush=True)
            monitor = self.metrics_processor.device_memory_monitor
            self.peak = PeakAcrossResets(allocated_peak)
            monitor.reset_peak_stats = self.peak.wrap(monitor.reset_peak_stats)

        def train_step(self, data_iterator):
            utils.device_module.synchronize()
            self.peak.take()
            start = time.perf_counter()
            super().train_step(data_iterator)
            utils.device_module.synchronize()
            t = self.job_config.training
            tokens = t.local_batch_size * t.seq_len * self.gradient_accumulation_steps
            seconds = time.perf_counter() - start
            print(f"peer-step {seconds:.6f} {tokens} {self.peak.take() / 2**30:.3f}", flush=True)

    return TimedTrainer


def main(argv: list[str]) -> None:
    options, titan_argv = parse_args(argv)
    sys.argv = [sys.argv[0], *titan_argv]  # before torchtitan is imported: its ConfigManager binds sys.argv then
    if options.cpu:
        cpu_shim()
    stand_in_for_datasets()
    register(options.model_args)
    from torchtitan.train import main as titan_main

    titan_main(timed_trainer())


if __name__ == "__main__":
    main(sys.argv[1:])
