"""Megatron-Core's own datasets: the reference data.blend_rule=megatron reproduces (tests/test_megatron_blend.py).

Run in its own process (megatron-core is a test-only dependency; importing it stays out of the test process, so
this module imports it only inside the functions that run there): `run_reference(spec, out_dir)` from a test, or

    python tests/megatron_reference.py SPEC.json OUT_DIR

SPEC.json is a list of scenarios, each {"name", "seq_length", "seed", "sizes": [train, valid, test], "samples":
[first, count]} plus either "blend" (Megatron-LM's --data-path list, e.g. ["0.7", "/x/a", "0.3", "/x/b"]) with
"split", or "blend_per_split" (--train-data-path / --valid-data-path / --test-data-path lists, null for none).
For every split Megatron-Core builds, OUT_DIR/<name>.npz holds, under "<split>/...": the blend's dataset index and
dataset sample index (when it is a BlendedDataset), every mid-level GPTDataset's num_samples, length, document ids
and document / sample / shuffle indices, and the tokens (seq_length + 1 each) of samples [first, first + count).
"split_bounds" in SPEC.json ([[num_documents, split], ...]) asks for Megatron-Core's document range bounds of each
split part, written to OUT_DIR/split_bounds.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SPLITS = ("train", "valid", "test")


def run_reference(spec: dict, out_dir: Path) -> None:
    """Megatron-Core's datasets for `spec` (the module docstring's SPEC.json) written to out_dir, built by this
    script in a process of its own."""
    (out_dir / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, __file__, str(out_dir / "spec.json"), str(out_dir)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


class Tokenizer:
    """What GPTDatasetConfig reads of a tokenizer: the end-of-document and padding ids."""

    eod, pad, vocab_size = 0, -1, None
    unique_identifiers = {"class": "Tokenizer"}


def build(scenario: dict) -> list:
    """Megatron-LM's pretrain_gpt.py path: blend lists parsed by get_blend_from_list, then the builder."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    if "blend" in scenario:
        blend = {"blend": get_blend_from_list(scenario["blend"]), "split": scenario["split"]}
    else:
        blend = {"blend_per_split": [get_blend_from_list(paths) for paths in scenario["blend_per_split"]]}
    config = GPTDatasetConfig(
        random_seed=scenario["seed"], sequence_length=scenario["seq_length"], tokenizer=Tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=None,  # megatron-core 0.16.1 caches blends only under torch.distributed; indices go beside
        **blend,             # each corpus instead
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, scenario["sizes"], lambda: True, config).build()


def record(dataset, first: int, count: int) -> dict[str, np.ndarray]:
    """The arrays of one split: the blend's indices, each mid-level dataset's, and samples [first, first + count)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    out = {"length": np.array(len(dataset))}
    if isinstance(dataset, BlendedDataset):
        out["dataset_index"], out["dataset_sample_index"] = dataset.dataset_index, dataset.dataset_sample_index
    for p, part in enumerate(parts):
        out[f"part{p}/num_samples"] = np.array(part.num_samples)
        out[f"part{p}/length"] = np.array(len(part))
        out[f"part{p}/document_ids"] = part.indices
        for name in ("document_index", "sample_index", "shuffle_index"):
            out[f"part{p}/{name}"] = getattr(part, name)
    windows = []
    for i in range(first, first + count):
        sample = dataset[i]
        windows.append(np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]]))
    out["samples"] = np.stack(windows)
    return out


def split_bounds(num_documents: int, split: str) -> list[list[int] | None]:
    """Megatron-Core's [begin, end) document range of each split part (None where the part has no weight)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if m is None else [int(round(m[0] * float(num_documents))), int(round(m[1] * float(num_documents)))]
            for m in matrix]


def main(spec_path: str, out_dir: str) -> None:
    spec, out = json.loads(Path(spec_path).read_text()), Path(out_dir)
    for scenario in spec["scenarios"]:
        arrays = {}
        for split, dataset in zip(SPLITS, build(scenario)):
            if dataset is not None:
                first, count = scenario["samples"] if split == "train" else (0, min(8, len(dataset)))
                arrays.update({f"{split}/{key}": value for key, value in record(dataset, first, count).items()})
        np.savez(out / f"{scenario['name']}.npz", **arrays)
    bounds = [split_bounds(n, split) for n, split in spec.get("split_bounds", [])]
    (out / "split_bounds.json").write_text(json.dumps(bounds))


if __name__ == "__main__":
    main(*sys.argv[1:])
