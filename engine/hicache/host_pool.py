"""HostKVPool: the host-memory tier's KV pages, per layer K and V, one slot per token (as the
device pool), with its own slot allocator. On CUDA the buffer is pinned and copies run on a copy
stream; each copy is complete when its call returns (the slots it read or wrote may be reused at
once), so the caller needs no synchronization of its own.

Under tensor parallelism every rank holds a host tier of its own KV heads, slot for slot as rank
0's: rank 0's pool logs its copies (`log_copies`, `take_copies`), and the other ranks apply the
same copies in the same order (`apply_copies`) before the next forward they run."""

from __future__ import annotations

import threading

import torch

from engine.memory import KVCache, TokenToKVPoolAllocator

CPU = torch.device("cpu")
# A logged copy: (BACKUP: device -> host, or LOAD: host -> device, device slots, host slots).
BACKUP, LOAD = 0, 1
HostCopy = tuple[int, list[int], list[int]]


def kv_shape(kv_cache: KVCache) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a device pool."""
    k0 = kv_cache.k[0]
    return len(kv_cache.k), k0.shape[1], k0.shape[2]


def gather_kv(kv_cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
    """The KV of device `slots` as one host tensor [2, layers, n, kv_heads, head_dim]."""
    index = slots.to(device=kv_cache.k[0].device, dtype=torch.int64)
    out = torch.stack(
        [torch.stack([buf[index] for buf in bufs]) for bufs in (kv_cache.k, kv_cache.v)]
    )
    return out.to(CPU)


class HostKVPool:
    """`size` token slots of KV in host memory (slot 0 unused, as on the device), laid out
    [2 (K, V), layers, size + 1, kv_heads, head_dim]."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        self.device = device  # the device pool's device
        self.pinned = device.type == "cuda"
        self.kv = torch.zeros(
            (2, num_layers, size + 1, kv_heads, head_dim), dtype=dtype, pin_memory=self.pinned
        )
        self.allocator = TokenToKVPoolAllocator(size, CPU)
        self.bytes_per_token = KVCache.bytes_per_token(num_layers, kv_heads, head_dim, dtype)
        self.copy_stream = torch.cuda.Stream(device) if self.pinned else None
        self._log: list[HostCopy] | None = None  # rank 0 of several: the copies not sent yet
        self._log_lock = threading.Lock()  # appended by the scheduler, taken by the forward thread

    @classmethod
    def for_device_pool(
        cls, kv_cache: KVCache, device_tokens: int, ratio: float, size_gb: float
    ) -> HostKVPool:
        """Sized by `size_gb` (GB of KV) when set, else `ratio` x the device pool's tokens."""
        layers, heads, dim = kv_shape(kv_cache)
        dtype, device = kv_cache.k[0].dtype, kv_cache.k[0].device
        per_token = KVCache.bytes_per_token(layers, heads, dim, dtype)
        size = int(size_gb * 1e9) // per_token if size_gb else int(device_tokens * ratio)
        return cls(max(size, 1), layers, heads, dim, dtype, device)

    # ---- slots -----------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.allocator.available_size()

    def used_size(self) -> int:
        return self.size - self.allocator.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    # ---- the copy log (tensor parallelism) -------------------------------------------------
    def log_copies(self) -> None:
        """From now on, keep every device <-> host copy for `take_copies`."""
        self._log = []

    def take_copies(self) -> list[HostCopy]:
        """The copies logged since the last call, in order."""
        if self._log is None:
            return []
        with self._log_lock:
            out, self._log = self._log, []
        return out

    def _logged(self, kind: int, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        if self._log is not None:
            with self._log_lock:
                self._log.append((kind, device_slots.tolist(), host_slots.tolist()))

    def apply_copies(self, kv_cache: KVCache, copies: list[HostCopy]) -> None:
        """Another rank's side of rank 0's copies: the same slots of this rank's pools, in order."""
        for kind, device_slots, host_slots in copies:
            dev = torch.tensor(device_slots, dtype=torch.int64)
            host = torch.tensor(host_slots, dtype=torch.int64)
            if kind == BACKUP:
                self.backup_from_device(kv_cache, dev, host)
            elif kind == LOAD:
                self.load_to_device(kv_cache, host, dev)
            else:
                raise ValueError(f"unknown host copy kind {kind}")

    # ---- copies ----------------------------------------------------------------------------
    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """[2, layers, n, kv_heads, head_dim] of host slots (a copy)."""
        return self.kv[:, :, slots]

    def write(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Store [2, layers, n, kv_heads, head_dim] at host slots."""
        self.kv[:, :, slots] = data.to(self.kv.dtype)

    def load_to_device(
        self, kv_cache: KVCache, host_slots: torch.Tensor, device_slots: torch.Tensor
    ) -> int:
        """Copy host slots into device slots, every layer; returns the bytes moved."""
        staged = self.kv[:, :, host_slots]  # one gather for all layers (pinned below on CUDA)
        if self.copy_stream is None:
            index = device_slots.to(torch.int64)
            for layer in range(len(kv_cache.k)):
                kv_cache.k[layer][index] = staged[0, layer]
                kv_cache.v[layer][index] = staged[1, layer]
        else:
            staged = staged.pin_memory()
            stream = self.copy_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the slots' last writers
            with torch.cuda.stream(stream):
                index = device_slots.to(self.device, dtype=torch.int64, non_blocking=True)
                data = staged.to(self.device, non_blocking=True)
                for layer in range(len(kv_cache.k)):
                    kv_cache.k[layer][index] = data[0, layer]
                    kv_cache.v[layer][index] = data[1, layer]
            stream.synchronize()  # the forward that reads them may run on any stream
        # Logged once made: a failed copy is not repeated on the other ranks.
        self._logged(LOAD, device_slots, host_slots)
        return staged.numel() * staged.element_size()

    def backup_from_device(
        self, kv_cache: KVCache, device_slots: torch.Tensor, host_slots: torch.Tensor
    ) -> int:
        """Copy device slots into host slots, every layer; returns the bytes moved."""
        if self.copy_stream is None:
            data = gather_kv(kv_cache, device_slots)
        else:
            stream = self.copy_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                index = device_slots.to(self.device, dtype=torch.int64, non_blocking=True)
                gathered = torch.stack(
                    [torch.stack([buf[index] for buf in bufs]) for bufs in (kv_cache.k, kv_cache.v)]
                )
                data = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                data.copy_(gathered, non_blocking=True)
            stream.synchronize()  # the device slots are freed (and reused) right after
        self.kv[:, :, host_slots] = data
        self._logged(BACKUP, device_slots, host_slots)
        return data.numel() * data.element_size()
