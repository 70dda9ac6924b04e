"""Copy a request's KV out of the pool into one contiguous buffer, and back into other slots."""

from __future__ import annotations

import torch

from engine.memory import KVCache


def gather_kv(kv_cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
    """[2, layers, len(slots), kv_heads, head_dim]: the K and V at `slots`, one buffer."""
    index = slots.to(device=kv_cache.k[0].device, dtype=torch.int64)
    return torch.stack([torch.stack([buf[index] for buf in bufs]) for bufs in (kv_cache.k, kv_cache.v)])


def scatter_kv(kv_cache: KVCache, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write a gather_kv buffer into `slots` (shapes and dtype must match this pool)."""
    layers, k0 = len(kv_cache.k), kv_cache.k[0]
    expected = (2, layers, len(slots), *k0.shape[1:])
    if tuple(kv.shape) != expected or kv.dtype != k0.dtype:
        raise ValueError(f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit this pool "
                         f"({expected} {k0.dtype})")
    index = slots.to(device=k0.device, dtype=torch.int64)
    kv = kv.to(k0.device)
    for layer in range(layers):
        kv_cache.k[layer][index] = kv[0, layer]
        kv_cache.v[layer][index] = kv[1, layer]
