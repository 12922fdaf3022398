"""The bytes of every tensor storage alive on a simulated rank, by kind, and what they were at the peak.

Fake tensors allocate nothing, but each still has a storage with a size, so the dry run counts memory as an
allocator would see it: every storage an operation creates is counted from the operation that made it until
its last tensor dies (a weak reference to the storage) or it is resized (ZeRO-3 frees a gathered bucket, the
pipeline frees a sent activation, by resizing the storage to 0 bytes through parallel/storage.py's operator,
which this mode sees). A view counts nothing of its own.

Why not torch.distributed._tools.MemTracker: it sorts memory by module and by torch's own categories (a
parameter, its .grad, an optimizer state), while megalite keeps gradients in flat bucket buffers and main
weights beside the parameters; what matters here is megalite's kinds, the planner's categories:

- a storage starts as `transient` (anything a step makes) or as the kind set by `making(kind)`;
- `label(tensors, kind)` names the storages of known objects (parameters, gradient buffers, main weights,
  optimizer state) once they exist;
- what autograd saves for backward becomes `activations` (saved-tensor hooks see every saved tensor);
- `host` is memory off the device (the full-shape draws of initialisation, offloaded optimizer state): it is
  counted in `totals` and `host_peak`, not in the device's `live` and `peak`.

The peak keeps the total of each kind at the moment of the most bytes (a small dict copy per new peak). A tensor
made before the peak and saved only after it (the loss's logits, saved as its forward ends) is moved to the
activations in the peak's totals too: it was alive then, and is what the planner counts as an activation.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megalite.parallel.storage import RESIZE


def _maker() -> str:
    """The innermost megalite line (outside this package) on the stack: the code that made a storage."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/megalite/" in path and "/dryrun/" not in path:
            return f"{path.rsplit('/megalite/', 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


KINDS = ("weights", "gradients", "main_weights", "optimizer", "activations", "transient")


class LiveBytes(TorchDispatchMode):
    """While active (inside the fake-tensor mode), counts the live bytes of every storage by kind."""

    def __init__(self, sites: int = 0) -> None:
        """`sites`: also keep the `sites` largest storages alive at the peak with the code that made each (slower:
        a stack walk per storage)."""
        super().__init__()
        self.entries: dict[int, list] = {}  # id(storage) -> [weakref, nbytes, kind, site, serial]
        self.made = self.made_at_peak = 0  # storages made so far, and by the peak
        self.totals: Counter[str] = Counter()
        self.live = self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.kind = "transient"  # the kind new storages get
        self.sites, self.largest_at_peak = sites, []
        self.host_peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.observe(func, args, out)
        return out

    def observe(self, func: Any, args: tuple, out: Any) -> None:
        """Count what operation `func` on `args` made (`out`) or resized: this mode's own dispatch calls it, and so
        does a fake-tensor mode that counts into this object itself (fake_world.py `fake_tensors`)."""
        if func is RESIZE:  # ZeRO-3 frees or re-grows a gathered bucket, the pipeline frees a sent activation
            key = id(args[0].untyped_storage())
            if key in self.entries:
                self._resize(key, args[0].untyped_storage().nbytes())
        elif isinstance(out, torch.Tensor):
            self._track(out.untyped_storage())
        elif isinstance(out, (tuple, list)):  # not the devices, sizes and flags most calls return
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self._track(value.untyped_storage())

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.entries:
            return
        site = _maker() if self.sites else ""
        self.made += 1
        self.entries[key] = [weakref.ref(storage, lambda _, key=key: self._forget(key)), 0, self.kind, site, self.made]
        self._resize(key, storage.nbytes())

    def _forget(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._move(entry[2], -entry[1])

    def _resize(self, key: int, nbytes: int) -> None:
        entry = self.entries[key]
        delta, entry[1] = nbytes - entry[1], nbytes
        self._move(entry[2], delta)

    def _move(self, kind: str, delta: int) -> None:
        self.totals[kind] += delta
        if kind == "host":
            self.host_peak = max(self.host_peak, self.totals["host"])
            return
        self.live += delta
        if self.live > self.peak:
            self._new_peak()

    def _new_peak(self) -> None:
        self.peak, self.at_peak, self.made_at_peak = self.live, dict(self.totals), self.made
        if self.sites:
            alive = sorted(self.entries.values(), key=lambda entry: -entry[1])[:self.sites]
            self.largest_at_peak = [(nbytes, kind, site) for _, nbytes, kind, site, _ in alive]

    def relabel(self, storage: torch.UntypedStorage, kind: str) -> None:
        """Count `storage` (tracked now if it was not) as `kind` from here on."""
        self._track(storage)
        entry = self.entries[id(storage)]
        self._move(entry[2], -entry[1])
        self._move(kind, entry[1])
        if entry[2] == "transient" and kind == "activations" and entry[4] <= self.made_at_peak:
            self.at_peak["transient"] -= entry[1]  # alive at the peak, saved since (module docstring)
            self.at_peak["activations"] = self.at_peak.get("activations", 0) + entry[1]
        entry[2] = kind

    def label(self, tensors: Iterable[torch.Tensor | None], kind: str) -> None:
        for tensor in tensors:
            if tensor is not None:
                self.relabel(tensor.untyped_storage(), kind)

    def kind_of(self, tensor: torch.Tensor) -> str | None:
        entry = self.entries.get(id(tensor.untyped_storage()))
        return entry[2] if entry is not None else None

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self._new_peak()

    @contextlib.contextmanager
    def making(self, kind: str) -> Iterator[None]:
        """Storages made inside the block start as `kind`."""
        before, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = before

    @contextlib.contextmanager
    def counting(self) -> Iterator[LiveBytes]:
        """Activate the mode (which follows storage resizes, parallel/storage.py) and mark what autograd saves as
        activations."""
        with self, self.counting_saved():
            yield self

    @contextlib.contextmanager
    def counting_saved(self) -> Iterator[LiveBytes]:
        """Mark what autograd saves as activations (inside a mode that calls `observe`, `counting` without the
        mode)."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if self.kind_of(tensor) == "transient":
                self.relabel(tensor.untyped_storage(), "activations")
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield self
