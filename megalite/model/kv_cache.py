"""Keys and values of past tokens, so generation runs each new token through the model once.

Without a cache every generated token re-runs the whole sequence (quadratic work); with it a
step computes only the new tokens' queries, keys and values and attends to the stored ones.
Tensors are preallocated for `capacity` tokens, so a step writes into place and never copies
the past. A layer with a sliding window keeps only the window - 1 newest tokens (all a later query sees): its
step attends to those and the new ones, and keeps the newest again.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's past keys and values, [batch, kv heads, tokens, head dim] each (keys and values may
    differ in width: latent attention caches its compressed latent and its rotary key, model/latent_attention.py)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.length = capacity, 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v ([batch, kv heads, new, head dim]); returns all keys and values so far, or
        with a sliding `window` the window - 1 before the new tokens and theirs (the last ones a query sees)."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; {end} needed: create it with a larger capacity")
        if window is not None:
            return self._append_windowed(k, v, window)
        if self.keys is None:
            self.keys = k.new_empty(k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.values = v.new_empty(v.shape[0], v.shape[1], self.capacity, v.shape[3])
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _append_windowed(self, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (new if kept is None else torch.cat((kept, new), dim=2)
                        for kept, new in ((self.keys, k), (self.values, v)))
        self.length += k.shape[2]
        start = max(keys.shape[2] - (window - 1), 0)
        self.keys, self.values = keys[:, :, start:], values[:, :, start:]
        return keys, values


class KVCache:
    """Every layer's LayerCache, by the layer's global index, created on first use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.layers: dict[int, LayerCache] = {}

    def __getitem__(self, index: int) -> LayerCache:
        if index not in self.layers:
            self.layers[index] = LayerCache(self.capacity)
        return self.layers[index]

    @property
    def length(self) -> int:
        """Tokens already cached (the position of the next token)."""
        return next(iter(self.layers.values())).length if self.layers else 0
