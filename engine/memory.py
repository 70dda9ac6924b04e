"""KV memory: the request -> token-slot table, the slot allocator and the per-layer K/V buffers."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """int32 table [max_running + 1, max_context]: row = request, entry = KV slot of that token.

    Row 0 is never handed out: padded batch rows (CUDA graphs, IDLE) point at it."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.free_slots: list[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, row: int) -> None:
        if not 1 <= row <= self.size or row in self.free_slots:
            raise RuntimeError(f"double free or bad request row {row}")
        self.free_slots.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start:start + len(slots)] = slots.to(torch.int32)


class TokenToKVPoolAllocator:
    """Page size 1: one slot per token. Slot 0 is reserved as the write target of padded rows."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        # Frees are batched: concatenating on every release would be O(n) per finished request.
        self._pending: list[torch.Tensor] = []
        self._pending_size = 0

    def available_size(self) -> int:
        return len(self.free_slots) + self._pending_size

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots) and self._pending:
            self._merge()
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._pending.append(slots.to(device=self.device, dtype=torch.int64))
            self._pending_size += slots.numel()

    def _merge(self) -> None:
        self.free_slots = torch.cat([self.free_slots, *self._pending])
        self._pending.clear()
        self._pending_size = 0

    def check_no_duplicates(self) -> None:
        """Debug check used by tests: every free slot is distinct and in range."""
        self._merge()
        s = self.free_slots
        if len(torch.unique(s)) != len(s) or (len(s) and (s.min() < 1 or s.max() > self.size)):
            raise RuntimeError("allocator free list is corrupt (duplicate or out-of-range slot)")


class KVCache:
    """Per layer `k[layer]`, `v[layer]` of shape [num_slots + 1, kv_heads, head_dim]."""

    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (size + 1, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][loc] = k
        self.v[layer][loc] = v

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
