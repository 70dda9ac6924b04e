"""The `ray` storage backend of the hierarchical cache: KV pages held by one named store actor per
store, which every engine actor of the cluster reaches by name, so an engine loads the prefixes
another engine wrote without a shared file system.

Registered as `hicache_storage_backend="ray"` when this module is imported (the engine layer
never imports Ray); `hicache_storage_path` names the store (default "default"). Pages are opaque
bytes to the store: the engine's storage tier verifies each one on load (engine/hicache/storage.py),
so the store only keeps them, up to a byte budget, least recently used dropped first."""

from __future__ import annotations

from collections import OrderedDict

import ray

from engine.hicache.storage import StorageBackend, register_storage_backend

STORE_NAMESPACE = "radixray"
DEFAULT_CAPACITY_BYTES = 8 << 30


class PageStore:
    """Bytes by key up to `capacity_bytes`; least recently used pages dropped first."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.pages: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        data = self.pages.get(key)
        if data is not None:
            self.pages.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            return
        old = self.pages.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)
        self.pages[key] = data  # one assignment: a reader sees the old page or the new one
        self.used_bytes += len(data)
        while self.used_bytes > self.capacity_bytes:
            _, dropped = self.pages.popitem(last=False)
            self.used_bytes -= len(dropped)

    def exists(self, key: str) -> bool:
        return key in self.pages

    def stats(self) -> dict[str, int]:
        return {
            "pages": len(self.pages),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
        }


@ray.remote(num_cpus=0)
class HiCacheStoreActor(PageStore):
    """A PageStore in its own process, named `radixray-hicache-<store>`; calls run one at a time."""


def store_actor(store: str, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> ray.actor.ActorHandle:
    """The store's actor, created by the first engine that asks (detached: it outlives engines)."""
    return HiCacheStoreActor.options(
        name=f"radixray-hicache-{store}",
        namespace=STORE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
    ).remote(capacity_bytes)


class RayStoreBackend(StorageBackend):
    """The storage tier's backend over a store actor; keys are prefixed with the tier's namespace
    (model identity and KV layout), so models share the store but never a page."""

    def __init__(self, store: str | None, namespace: str) -> None:
        self.actor = store_actor(store or "default")
        self.prefix = namespace + "/"

    def get(self, key: str) -> bytes | None:
        return ray.get(self.actor.get.remote(self.prefix + key))

    def put(self, key: str, data: bytes) -> None:
        ray.get(self.actor.put.remote(self.prefix + key, data))

    def exists(self, key: str) -> bool:
        return ray.get(self.actor.exists.remote(self.prefix + key))


register_storage_backend("ray", RayStoreBackend)
