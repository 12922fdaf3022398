"""Reading Megatron-LM's pickles without importing Megatron and without running code from them.

Megatron pickles its argparse namespace (`args`) into every checkpoint, and with it the values of its own
enums (ModelType, AttnBackend, RerunMode, ...), `signal.Signals` and, in the RNG state, numpy arrays; the
torch_dist format's `.metadata` is a pickle of torch.distributed.checkpoint's dataclasses. Both are read
here with allow-lists: torch's weights-only unpickler (tensors, containers, plain values) plus
- argparse.Namespace and signal.Signals, which only hold values;
- every `megatron.*` name a file refers to, as an inert `MegatronValue` record (Megatron pickles only enum
  members into these files; the record keeps the name and value and calls nothing);
- numpy's array reconstruction as an inert record too (it appears only in the RNG state, which megalite does
  not carry over);
- for `.metadata`, the dataclasses of torch.distributed.checkpoint that describe where each tensor lies.
Any other name stops the read with a message naming it.
"""

from __future__ import annotations

import argparse
import io
import pickle
import signal
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner


class MegatronValue:
    """A Megatron enum member (or anything else Megatron-defined) as a record: `name` (module.Class) and the
    value it was pickled with."""

    qualname = "megatron"

    def __init__(self, *args: Any) -> None:
        self.args = args

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else self.args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{self.qualname}{self.args!r}"


def _record_class(name: str) -> type[MegatronValue]:
    return type(name.rsplit(".", 1)[1], (MegatronValue,), {"qualname": name})


NUMPY_RECORDS = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray",
                 "numpy.dtype")


def _allowed(found: list[str]) -> list:
    """The safe globals for a file that refers to `found` (names torch's weights-only unpickler lacks)."""
    allowed: list = [argparse.Namespace, signal.Signals]
    for name in found:
        if name.startswith("megatron.") or name in NUMPY_RECORDS:
            allowed.append((_record_class(name), name))
    return allowed


def load_megatron_pickle(source: Path | bytes, what: str) -> Any:
    """A torch.save'd Megatron object (a file, or the bytes of one), read as described above. `what` names it
    in errors."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    found = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
    if isinstance(stream, io.BytesIO):
        stream.seek(0)
    try:
        with torch.serialization.safe_globals(_allowed(found)):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"{what}: refers to code megalite does not run while reading a checkpoint ({error}); "
                         "only tensors, plain values and Megatron's enums are read") from error


METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    ("torch.distributed.checkpoint.planner", "SavePlan"): planner.SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): planner.WriteItem,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): planner.WriteItemType,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): planner.TensorWriteData,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return METADATA_CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint metadata class")


def load_dcp_metadata(path: Path) -> metadata.Metadata:
    """A torch.distributed.checkpoint `.metadata` file, unpickled with only its own classes allowed."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError) as error:
        raise ValueError(f"{path}: not a torch.distributed.checkpoint metadata file megalite can read "
                         f"({error})") from error
