"""The storage tier: KV pages shared by every engine that can reach the backend.

A page is `page_size` tokens of KV (every layer, K and V) at a page-aligned position of a token
prefix; a prefix's last partial page is not stored. Its key chains sha256 over the prefix:
key(p) = sha256(key(p - 1) + the page's token ids), key(-1) = sha256 of the model identity and KV
layout, so two models (or dtypes, or page sizes) never share a page, and a page is found only
under the exact prefix that produced it.

A backend stores opaque bytes by key (`StorageBackend`; `file` here, the actor layer registers
a Ray one). The bytes are a header (the key, layout, token ids, payload checksum) and the payload;
`decode_page` verifies all of it, so a torn, corrupted or foreign file reads as a miss, never as
wrong KV. `StorageTier` is what the hierarchical cache uses: chained keys, background writes
(flushed by `close`) and loads by prefetch policy."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import struct
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from engine.errors import ConfigError

MAGIC = b"RRKVPAGE"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header bytes


class PageHeader(msgspec.Struct, frozen=True):
    key: str
    layout: str
    token_ids: list[int]
    checksum: str  # sha256 of the payload


class StorageBackend(ABC):
    """Bytes by key. `put` is atomic: a concurrent `get` sees the whole page or none, and
    concurrent puts of one key (same bytes, from two engines) are safe. `get` returns None for a
    missing key. Calls come from the tier's worker threads."""

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    def exists(self, key: str) -> bool:
        return self.get(key) is not None

    def close(self) -> None:
        """Release what the backend holds (nothing, unless it says otherwise)."""
        return None


# name -> factory(path, namespace): the actor layer adds its own at import.
STORAGE_BACKENDS: dict[str, Callable[[str | None, str], StorageBackend]] = {}


def register_storage_backend(
    name: str, factory: Callable[[str | None, str], StorageBackend]
) -> None:
    STORAGE_BACKENDS[name] = factory


def create_storage_backend(name: str, path: str | None, namespace: str) -> StorageBackend:
    factory = STORAGE_BACKENDS.get(name)
    if factory is None:  # "ray" is registered by the actor layer (actors/hicache_store.py)
        raise ConfigError(
            f"unknown hicache_storage_backend {name!r}; known: {sorted(STORAGE_BACKENDS)}"
        )
    return factory(path, namespace)


class FileStorageBackend(StorageBackend):
    """One file per page under `path/namespace/ab/<key>.kv`; written to a temporary file in the
    same folder and renamed over the final name (atomic on POSIX file systems)."""

    def __init__(self, path: str, namespace: str) -> None:
        self.root = os.path.join(path, namespace)
        os.makedirs(self.root, exist_ok=True)

    def _file(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".kv")

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except OSError:
            return None

    def put(self, key: str, data: bytes) -> None:
        final = self._file(key)
        folder = os.path.dirname(final)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def exists(self, key: str) -> bool:
        return os.path.exists(self._file(key))


register_storage_backend("file", lambda path, namespace: FileStorageBackend(path or "", namespace))


# ---- pages ---------------------------------------------------------------------------------
def layout_of(shape: tuple[int, int, int], dtype: torch.dtype, page_size: int) -> str:
    layers, heads, dim = shape
    return f"L{layers}-H{heads}-D{dim}-{str(dtype).removeprefix('torch.')}-P{page_size}"


def chain_seed(model_id: str, layout: str) -> bytes:
    return hashlib.sha256(f"radixray-hicache-v{VERSION}|{model_id}|{layout}".encode()).digest()


def storage_namespace(model_id: str, layout: str) -> str:
    """The folder (or key prefix) of one model's pages in a shared backend."""
    return chain_seed(model_id, layout).hex()[:16]


def page_keys(seed: bytes, tokens: list[int], page_size: int, num_pages: int) -> list[str]:
    """Chained keys of the first num_pages pages of `tokens`."""
    raw = np.asarray(tokens[: num_pages * page_size], dtype="<i8").tobytes()
    step, keys, prev = page_size * 8, [], seed
    for p in range(num_pages):
        prev = hashlib.sha256(prev + raw[p * step : (p + 1) * step]).digest()
        keys.append(prev.hex())
    return keys


def encode_page(key: str, layout: str, token_ids: list[int], kv: torch.Tensor) -> bytes:
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = msgspec.json.encode(
        PageHeader(key, layout, token_ids, hashlib.sha256(payload).hexdigest())
    )
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload


def decode_page(
    data: bytes | None,
    key: str,
    layout: str,
    token_ids: list[int],
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The page's KV [2, layers, page, kv_heads, head_dim], or None unless every check passes."""
    if data is None or len(data) < _PREFIX.size:
        return None
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION or _PREFIX.size + header_len > len(data):
        return None
    try:
        header = msgspec.json.decode(
            data[_PREFIX.size : _PREFIX.size + header_len], type=PageHeader
        )
    except msgspec.DecodeError:
        return None
    payload = data[_PREFIX.size + header_len :]
    expect_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if (
        header.key != key
        or header.layout != layout
        or header.token_ids != token_ids
        or len(payload) != expect_bytes
        or hashlib.sha256(payload).hexdigest() != header.checksum
    ):
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


class StorageTier:
    """Chained page keys, background writes and prefetches over one backend. Called from the
    scheduler thread; the backend is called from two worker threads (writes in order on one,
    prefetches on the other)."""

    def __init__(
        self,
        backend: StorageBackend,
        page_size: int,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        model_id: str,
        prefetch_policy: str,
        prefetch_timeout_s: float,
        max_ready_pages: int = 4096,
    ) -> None:
        self.backend = backend
        self.page_size = page_size
        self.layout = layout_of(shape, dtype, page_size)
        self.seed = chain_seed(model_id, self.layout)
        layers, heads, dim = shape
        self.page_shape = (2, layers, page_size, heads, dim)
        self.dtype = dtype
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout_s = prefetch_timeout_s
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-write")
        self._fetcher = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="hicache-prefetch"
        )
        self._pending_writes: set[concurrent.futures.Future] = set()
        self._known: OrderedDict[str, None] = (
            OrderedDict()
        )  # pages written (or queued) by this engine
        self._max_known = 1 << 20
        self._lock = threading.Lock()
        self._ready: OrderedDict[str, torch.Tensor] = OrderedDict()  # prefetched, verified pages
        self._max_ready = max_ready_pages
        self._inflight: dict[str, concurrent.futures.Future] = {}  # prefetches by first page key
        self.counters = {
            "pages_written": 0,
            "pages_read": 0,
            "pages_corrupt": 0,
            "bytes_written": 0,
            "bytes_read": 0,
            "write_errors": 0,
        }
        self._closed = False

    def keys(self, tokens: list[int], num_pages: int) -> list[str]:
        return page_keys(self.seed, tokens, self.page_size, num_pages)

    # ---- writes ----------------------------------------------------------------------------
    def write(self, tokens: list[int], gather: Callable[[int, int], torch.Tensor]) -> int | None:
        """Store every full page of `tokens` this engine has not stored yet; `gather(start, end)`
        returns the KV of tokens[start:end] as a host tensor (taken now: the slots may be reused
        after this call). Returns the first page queued, None if none was."""
        n = len(tokens) // self.page_size
        if n == 0 or self._closed:
            return None
        first: int | None = None
        for p, key in enumerate(self.keys(tokens, n)):
            if key in self._known:
                self._known.move_to_end(key)
                continue
            if first is None:
                first = p
            start = p * self.page_size
            ids = tokens[start : start + self.page_size]
            kv = gather(start, start + self.page_size)
            self._remember(key)
            fut = self._writer.submit(self._put, key, ids, kv)
            with self._lock:
                self._pending_writes.add(fut)
            fut.add_done_callback(self._write_done)
        return first

    def _write_done(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending_writes.discard(fut)

    def _remember(self, key: str) -> None:
        self._known[key] = None
        if len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def _put(self, key: str, ids: list[int], kv: torch.Tensor) -> None:
        try:
            if self.backend.exists(key):  # another engine wrote it: same bytes
                return
            data = encode_page(key, self.layout, ids, kv)
            self.backend.put(key, data)
            with self._lock:
                self.counters["pages_written"] += 1
                self.counters["bytes_written"] += len(data)
        except Exception:  # a failed write is a later miss, never an engine error
            with self._lock:
                self.counters["write_errors"] += 1

    # ---- loads -----------------------------------------------------------------------------
    def _fetch(self, key: str, ids: list[int]) -> torch.Tensor | None:
        data = self.backend.get(key)
        kv = decode_page(data, key, self.layout, ids, self.page_shape, self.dtype)
        with self._lock:
            if kv is not None:
                self.counters["pages_read"] += 1
                self.counters["bytes_read"] += len(data)
            elif data is not None:
                self.counters["pages_corrupt"] += 1
        return kv

    def _prefetch_run(self, keys: list[str], ids: list[list[int]]) -> None:
        for key, page_ids in zip(keys, ids):
            with self._lock:
                if key in self._ready:
                    continue
            kv = self._fetch(key, page_ids)
            if kv is None:
                return
            with self._lock:
                self._ready[key] = kv
                while len(self._ready) > self._max_ready:
                    self._ready.popitem(last=False)

    def load(self, tokens: list[int], first_page: int) -> list[torch.Tensor]:
        """Consecutive pages of `tokens` from page `first_page` on (only full pages), as the
        prefetch policy allows: each [2, layers, page_size, kv_heads, head_dim]."""
        n = len(tokens) // self.page_size
        if first_page >= n or self._closed:
            return []
        keys = self.keys(tokens, n)[first_page:]
        P = self.page_size
        ids = [tokens[(first_page + i) * P : (first_page + i + 1) * P] for i in range(len(keys))]
        if self.prefetch_policy == "wait_complete":
            out = []
            for key, page_ids in zip(keys, ids):
                with self._lock:
                    kv = self._ready.pop(key, None)
                kv = kv if kv is not None else self._fetch(key, page_ids)
                if kv is None:
                    break
                out.append(kv)
                self._remember(key)  # stored already: never written back
            return out
        with self._lock:
            fut = self._inflight.get(keys[0])
        if fut is None:
            fut = self._fetcher.submit(self._prefetch_run, keys, ids)
            with self._lock:
                self._inflight[keys[0]] = fut
            fut.add_done_callback(lambda _f, k=keys[0]: self._drop_inflight(k))
        if self.prefetch_policy == "timeout":
            concurrent.futures.wait([fut], timeout=self.prefetch_timeout_s)
        out = []
        with self._lock:
            for key in keys:
                kv = self._ready.pop(key, None)
                if kv is None:
                    break
                out.append(kv)
        for key in keys[: len(out)]:
            self._remember(key)
        return out

    def _drop_inflight(self, key: str) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    # ---- shutdown --------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every queued write; False if some were still pending at the timeout."""
        with self._lock:
            futures = list(self._pending_writes)
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        return not pending

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Flush pending writes, stop the workers and close the backend."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._writer.shutdown(wait=True)
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        self.backend.close()

    def snapshot_counters(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counters)
