"""HiRadixCache: the radix cache with a host tier (and optionally a storage tier) under the device
pool, SGLang's HiRadixCache.

A node's KV is on the device (`value`), in host memory (`host_value`) or both. Device nodes form a
subtree under the root (a device node's parent is on the device), so along any path the device
part comes first and the host-only part after it. Device eviction takes device leaves (no child
on the device) in the policy's order: a node with a host copy just gives up its device slots and
stays in the tree; one without is written to the host first under `write_back`, else dropped with
its host-only subtree. Host eviction takes host-only leaves, in the same policy's order.

`match_and_load` is what the CacheManager calls for admission: the device part of a match, plus
the host part (and storage pages after it, through the host tier) copied into freshly allocated
device slots, so the caller gets an ordinary device prefix. Room for that load may come from
evicting device nodes, except those of matches since the last allocation (their requests are
being admitted against those slots; `end_match_round`).

Accounting: `evictable_size`/`protected_size` count device tokens as in RadixCache; the host pool's
used slots are exactly those the nodes' `host_value`s hold (`check_host`)."""

from __future__ import annotations

import heapq
import time

import msgspec
import torch

from engine.errors import MemoryInvariantError
from engine.hicache.config import HiCacheConfig
from engine.hicache.eviction import create_eviction_policy
from engine.hicache.host_pool import HostKVPool, gather_kv, kv_shape
from engine.hicache.storage import StorageTier, create_storage_backend, layout_of, storage_namespace
from engine.memory import KVCache, TokenToKVPoolAllocator
from engine.radix_cache import RadixCache, TreeNode
from engine.token_trie import descend


class TierStats(msgspec.Struct, kw_only=True):
    """Per-tier counters since start: prompt tokens admitted from the tier (`hit_tokens`), bytes
    moved up into the tier above (`load_bytes`) and down from it (`write_bytes`), and the time spent
    loading (`load_seconds`, over `loads` loads)."""

    hit_tokens: int = 0
    load_bytes: int = 0
    write_bytes: int = 0
    load_seconds: float = 0.0
    loads: int = 0


class HiCacheStats(msgspec.Struct, kw_only=True):
    """What `CacheManager.hicache_stats` reports: per tier, plus the host tier's occupancy and the
    storage tier's page counters."""

    device: TierStats
    host: TierStats
    storage: TierStats
    host_used_tokens: int = 0
    host_total_tokens: int = 0
    host_evicted_tokens: int = 0
    storage_pages_written: int = 0
    storage_pages_read: int = 0
    storage_pages_corrupt: int = 0
    storage_write_errors: int = 0


class HiRadixCache(RadixCache):
    """RadixCache over a device pool, a host tier and an optional storage tier (module docstring)."""

    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        kv_cache: KVCache,
        config: HiCacheConfig,
        model_id: str = "",
        hidden_size: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.config = config
        self.write_policy = config.hicache_write_policy
        self.host = HostKVPool.for_device_pool(
            kv_cache, allocator.size, config.hicache_ratio, config.hicache_size
        )
        self.host_policy = create_eviction_policy(config.radix_eviction_policy, hidden_size)
        self.storage: StorageTier | None = None
        if config.hicache_storage_backend is not None:
            shape, dtype, page = (
                kv_shape(kv_cache),
                kv_cache.k[0].dtype,
                config.hicache_storage_page_size,
            )
            namespace = storage_namespace(model_id, layout_of(shape, dtype, page))
            backend = create_storage_backend(
                config.hicache_storage_backend, config.hicache_storage_path, namespace
            )
            self.storage = StorageTier(
                backend,
                page,
                shape,
                dtype,
                model_id,
                config.hicache_storage_prefetch_policy,
                config.hicache_storage_prefetch_timeout_s,
            )
        self.tiers = {name: TierStats() for name in ("device", "host", "storage")}
        self.host_evicted_tokens = 0
        # Host and storage events too (a subscriber asked for them; paths cost a walk each).
        self.tier_events = False
        # Nodes returned by matches since the last allocation, by id: load-back may not evict them.
        self._pending: dict[int, TreeNode] = {}
        super().__init__(
            allocator, create_eviction_policy(config.radix_eviction_policy, hidden_size)
        )

    def reset(self) -> None:
        super().reset()
        self.host.allocator = TokenToKVPoolAllocator(self.host.size, self.host.allocator.device)
        self._pending = {}

    # ---- matching ----------------------------------------------------------------------------
    def _walk(self, key: list[int]) -> tuple[list[TreeNode], int, int]:
        """Match key (splitting at the end): the path, how many of its nodes are on the device,
        and the tokens the whole path holds."""
        now = self._tick()
        path, matched = descend(self.root, key, len(key), self._split)
        d = 0
        for node in path:
            node.last_access = now
            if node.value is not None:
                d += 1
        return path, d, matched

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The device part of the longest cached prefix (nothing is loaded)."""
        path, d, _ = self._walk(key)
        if d == 0:
            return self._empty, self.root
        return torch.cat([n.value for n in path[:d]]), path[d - 1]

    def match_and_load(self, key: list[int]) -> tuple[torch.Tensor, TreeNode, int, int]:
        """Longest prefix of key held by any tier, loaded onto the device as far as the pool has
        room: (device slots, node to lock, tokens loaded from the host, of which from storage)."""
        path, d, matched = self._walk(key)
        device_nodes, host_nodes = path[:d], path[d:]
        anchor = device_nodes[-1] if device_nodes else self.root
        for n in host_nodes:
            n.host_ref += 1  # loading them: host eviction must leave them
        try:
            from_storage = 0
            if self.storage is not None and matched < len(key):
                node = self._load_from_storage(path[-1] if path else self.root, key, matched)
                if node is not None:
                    node.host_ref += 1
                    host_nodes.append(node)
                    from_storage = len(node.key)
            loaded = self._load_back(anchor, host_nodes) if host_nodes else []
        finally:
            for n in host_nodes:
                n.host_ref -= 1
        nodes = device_nodes + loaded
        if not nodes:
            return self._empty, self.root, 0, 0
        self._pending[id(nodes[-1])] = nodes[-1]
        n_loaded = sum(len(n.key) for n in loaded)
        # Storage pages are the last host node: they count only if it was loaded.
        storage_loaded = from_storage if loaded and loaded[-1] is host_nodes[-1] else 0
        return torch.cat([n.value for n in nodes]), nodes[-1], n_loaded, storage_loaded

    def end_match_round(self) -> None:
        """An allocation for admitted (locked) requests is under way: matches before this point
        no longer need protecting from load-back eviction (unadmitted requests match again)."""
        self._pending.clear()

    def _load_back(self, anchor: TreeNode, host_nodes: list[TreeNode]) -> list[TreeNode]:
        """Copy the leading host nodes that fit into new device slots; returns those loaded."""
        need = sum(len(n.key) for n in host_nodes)
        pinned = [anchor, *self._pending.values()]  # this match's device part and earlier matches'
        for node in pinned:
            self.inc_lock_ref(node)
        try:
            free = self.allocator.available_size()
            if free < need:
                self.evict(need - free)
            room, take, total = self.allocator.available_size(), [], 0
            for n in host_nodes:
                if total + len(n.key) > room:
                    break
                take.append(n)
                total += len(n.key)
            if not take:
                return []
            slots = self.allocator.alloc(total)
            t0 = time.perf_counter()
            moved = self.host.load_to_device(
                self.kv_cache, torch.cat([n.host_value for n in take]), slots
            )
            stats = self.tiers["host"]
            stats.load_seconds += time.perf_counter() - t0
            stats.loads += 1
            stats.load_bytes += moved
            offset = 0
            for n in take:
                n.value = slots[offset : offset + len(n.key)]
                offset += len(n.key)
            self._evictable += total
            if self.on_event is not None:
                path = self._path(take[-1])
                self.on_event("stored", path, len(path) - total)
            return take
        finally:
            for node in pinned:
                self.dec_lock_ref(node)

    def _load_from_storage(self, parent: TreeNode, key: list[int], matched: int) -> TreeNode | None:
        """Storage pages after the matched prefix, into the host tier as one host-only node under
        `parent` (whose path is key[:matched])."""
        storage = self.storage
        P = storage.page_size
        first = matched // P
        t0 = time.perf_counter()
        pages = storage.load(key, first)
        if not pages:
            return None
        end = (first + len(pages)) * P
        if end <= matched:
            return None
        n = end - matched
        data = torch.cat(pages, dim=2)[:, :, matched - first * P :]
        slots = self._host_alloc(n)
        if slots is None:
            return None
        self.host.write(slots, data)
        stats = self.tiers["storage"]
        stats.load_seconds += time.perf_counter() - t0
        stats.loads += 1
        stats.load_bytes += data.numel() * data.element_size()
        node = TreeNode(key[matched:end], None, parent)
        node.host_value, node.depth, node.last_access = slots, matched, self._clock
        parent.children[key[matched]] = node
        if self.tier_events and self.on_event is not None:
            self.on_event("stored", key[:end], matched, "host")
        return node

    # ---- inserts -----------------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor, priority: int | None = None) -> int:
        """Insert key -> value. Host-only nodes on the path take the caller's slots (they are on
        the device again); returns the tokens the device already had (value[:n] are duplicates)."""
        path, d, matched = self._walk(key)
        if priority is not None:
            for node in path:
                node.priority = min(node.priority, priority)
        have = sum(len(n.key) for n in path[:d])
        offset, added = have, []
        for node in path[d:]:
            node.value = value[offset : offset + len(node.key)].clone()
            offset += len(node.key)
            added.append(node)
        if matched < len(key):
            parent = path[-1] if path else self.root
            leaf = TreeNode(key[matched:], value[matched:].clone(), parent)
            leaf.last_access, leaf.depth = self._clock, matched
            if priority is not None:
                leaf.priority = priority
            parent.children[key[matched]] = leaf
            added.append(leaf)
            path.append(leaf)
        if added:
            self._evictable += len(key) - have
            if self.on_event is not None:
                self.on_event("stored", list(key), have)
            if self.write_policy == "write_through":
                for node in added:
                    if node.host_value is None:
                        self._backup(node)
        if self.storage is not None and len(key) >= self.storage.page_size:
            self._write_storage(key, path)
        return have

    def _write_storage(self, key: list[int], path: list[TreeNode]) -> None:
        """Write-through of the committed prefix `key`, whose nodes (`path`) are all on the device."""
        slots: torch.Tensor | None = None

        def gather(start: int, end: int) -> torch.Tensor:
            nonlocal slots
            if slots is None:
                slots = torch.cat([n.value for n in path])
            data = gather_kv(self.kv_cache, slots[start:end])
            self.tiers["storage"].write_bytes += data.numel() * data.element_size()
            return data

        first = self.storage.write(key, gather)
        if first is not None and self.tier_events and self.on_event is not None:
            end = len(key) // self.storage.page_size * self.storage.page_size
            self.on_event("stored", list(key[:end]), first * self.storage.page_size, "storage")

    def record_hit(self, node: TreeNode, priority: int | None = None) -> None:
        super().record_hit(node, priority)
        if self.write_policy == "write_through_selective":
            while node is not self.root:
                if node.hit_count >= 2 and node.host_value is None and node.value is not None:
                    self._backup(node)
                node = node.parent

    # ---- host tier ---------------------------------------------------------------------------
    def _host_alloc(self, n: int) -> torch.Tensor | None:
        if self.host.available_size() < n:
            self.evict_host(n - self.host.available_size())
        return self.host.alloc(n)

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node's KV to new host slots; False when the host tier has no room."""
        slots = self._host_alloc(len(node.key))
        if slots is None:
            return False
        moved = self.host.backup_from_device(self.kv_cache, node.value, slots)
        self.tiers["device"].write_bytes += moved
        node.host_value = slots
        if self.tier_events and self.on_event is not None:
            self.on_event("stored", self._path(node), node.depth, "host")
        return True

    def evict_host(self, num_tokens: int) -> int:
        """Free at least num_tokens host slots: host-only leaves in the policy's order."""
        key, now = self.host_policy.key, self._clock
        heap = [
            (key(n, now), n)
            for n in self._nodes()
            if n.value is None and not n.children and n.host_ref == 0
        ]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_tokens:
            _, leaf = heapq.heappop(heap)
            if self.tier_events and self.on_event is not None:
                self.on_event("removed", self._path(leaf), leaf.depth, "host")
            self.host.free(leaf.host_value)
            evicted += len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if (
                parent is not self.root
                and parent.value is None
                and not parent.children
                and parent.host_ref == 0
            ):
                heapq.heappush(heap, (key(parent, now), parent))
        self.host_evicted_tokens += evicted
        return evicted

    # ---- device eviction ---------------------------------------------------------------------
    @staticmethod
    def _device_leaf(node: TreeNode) -> bool:
        return node.value is not None and not any(
            c.value is not None for c in node.children.values()
        )

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens device slots from unlocked device leaves, in the policy's
        order; each keeps its KV in the host tier when it has (or, write_back, gets) a copy."""
        key, now = self.policy.key, self._clock
        heap = [(key(n, now), n) for n in self._nodes() if n.lock_ref == 0 and self._device_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_tokens:
            _, leaf = heapq.heappop(heap)
            if leaf.host_value is None and self.write_policy == "write_back":
                self._backup(leaf)
            if self.on_event is not None:
                path = self._path(leaf)
                self.on_event("removed", path, len(path) - len(leaf.key))
            self.allocator.free(leaf.value)
            leaf.value = None
            evicted += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            if (
                leaf.host_value is None
            ):  # no copy anywhere: it leaves the tree, with its host-only subtree
                self._drop_subtree(leaf)
            if parent is not self.root and parent.lock_ref == 0 and self._device_leaf(parent):
                heapq.heappush(heap, (key(parent, now), parent))
        return evicted

    def _drop_subtree(self, node: TreeNode) -> None:
        if (
            node.children and self.tier_events and self.on_event is not None
        ):  # host-only nodes go too
            self.on_event("removed", self._path(node), node.depth, "host")
        del node.parent.children[node.key[0]]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.host_value is not None:
                self.host.free(n.host_value)
                self.host_evicted_tokens += len(n.key)

    # ---- queries -----------------------------------------------------------------------------
    def total_tokens(self) -> int:
        """Device tokens the tree holds."""
        return sum(len(n.key) for n in self._nodes() if n.value is not None)

    def host_tokens(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.host_value is not None)

    def leaf_paths(self) -> list[list[int]]:
        """The device view: the token path of every device leaf."""
        return [self._path(n) for n in self._nodes() if self._device_leaf(n)]

    def host_leaf_paths(self) -> list[list[int]]:
        """The host view: the token path of every node with a host copy and none below it."""
        return [
            self._path(n)
            for n in self._nodes()
            if n.host_value is not None
            and not any(c.host_value is not None for c in n.children.values())
        ]

    def check_host(self) -> None:
        """Host-tier invariant (no request running): the pool's used slots are exactly the
        nodes' host slots, nothing is pinned for a load, every node is on some tier, and device
        nodes hang from device nodes."""
        held, pinned = 0, 0
        for n in self._nodes():
            if n.host_value is not None:
                held += len(n.host_value)
            pinned += n.host_ref
            if n.value is None and n.host_value is None:
                raise MemoryInvariantError("a radix node holds KV in no tier")
            if n.value is not None and n.parent is not self.root and n.parent.value is None:
                raise MemoryInvariantError("a device node hangs from a host-only node")
        used = self.host.used_size()
        if used != held:
            raise MemoryInvariantError(f"host KV leak: {used} host slots used, nodes hold {held}")
        if pinned:
            raise MemoryInvariantError(f"{pinned} host nodes still pinned with no request running")

    def stats(self) -> HiCacheStats:
        counters = self.storage.snapshot_counters() if self.storage is not None else {}
        copy = {name: msgspec.structs.replace(t) for name, t in self.tiers.items()}
        return HiCacheStats(
            device=copy["device"],
            host=copy["host"],
            storage=copy["storage"],
            host_used_tokens=self.host.used_size(),
            host_total_tokens=self.host.size,
            host_evicted_tokens=self.host_evicted_tokens,
            storage_pages_written=counters.get("pages_written", 0),
            storage_pages_read=counters.get("pages_read", 0),
            storage_pages_corrupt=counters.get("pages_corrupt", 0),
            storage_write_errors=counters.get("write_errors", 0),
        )

    def close(self) -> None:
        """Flush the storage tier's pending writes and stop its workers."""
        if self.storage is not None:
            self.storage.close()
