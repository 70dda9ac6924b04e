"""CacheManager: the one owner of KV memory bookkeeping. Slot allocation (evicting from the prefix
cache when the free list runs short), `req_to_token` writes, a request's KV at its end (cached,
or released after a failure), the KV budget ("free + evictable") and the idle invariant.

The prefix cache behind it (`RadixCache`, or `NoRadixCache` when sharing is off) implements the
`PrefixCache` protocol and knows nothing of requests. What the cache stores and evicts goes out
as `KVEvent`s to subscribers (the actor forwards evictions to the cache-aware router).

With a `HiCacheConfig` the tree's eviction policy is `radix_eviction_policy`, and with
`enable_hierarchical_cache` the tree is a `HiRadixCache` (engine/hicache): a match that ends in
the host or storage tier is loaded into device slots here, inside `match_prefix`, so the
scheduler sees an ordinary device prefix (and counts it in `cached_tokens`). Its events name the
tier (`KVEvent.medium`): the router scores a host or storage hit between a pool hit and a recompute."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec
import torch

from engine.errors import ConfigError, MemoryInvariantError
from engine.hicache.config import DEFAULTS
from engine.hicache.eviction import create_eviction_policy
from engine.hicache.hiradix_cache import HiRadixCache
from engine.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from engine.radix_cache import NoRadixCache, RadixCache
from engine.req import Req

if TYPE_CHECKING:
    from engine.hicache.config import HiCacheConfig
    from engine.hicache.hiradix_cache import HiCacheStats


class OutOfKVError(RuntimeError):
    """The pool cannot hold a batch the scheduler already admitted: a budgeting bug."""


Medium = Literal["device", "host", "storage"]
MEDIUMS: tuple[str, ...] = ("device", "host", "storage")


class KVEvent(msgspec.Struct, frozen=True, array_like=True):
    """The prefix cache now holds ("stored") or no longer holds ("removed") the KV of
    `token_ids[start:]` in tier `medium`, whose parent path `token_ids[:start]` it holds there
    (and keeps); or a request whose prompt is `token_ids` arrived ("queued": its KV is being
    computed here, and will be stored) or ended ("done"). Queued prompts let every router follow
    a prefix to the engine computing it while the request still waits there, before any "stored"
    event. `medium`: "device" (the KV pool), "host" (the host tier: a load away) or "storage" (the
    shared storage tier: every engine that reaches it can load it; never "removed")."""

    kind: Literal["stored", "removed", "queued", "done"]
    token_ids: list[int]
    start: int = 0
    medium: Medium = "device"
    # The LoRA adapter whose KV this is (None: the base model): a prefix is shared only under the
    # same adapter, so an index keys its paths by it too.
    lora_name: str | None = None


# A LoRA request's radix key is its token ids offset by its adapter load's id times this: keys of
# different adapters never share a first token, so never a prefix (and ids stay within int64).
LORA_KEY_SHIFT = 1 << 32


def lora_key(req: Req, ids: list[int]) -> list[int]:
    """The radix key of `ids` (a prefix of the request's tokens) in the request's adapter's
    namespace (the ids themselves for the base model)."""
    if not req.lora_id:
        return ids
    offset = req.lora_id * LORA_KEY_SHIFT
    return [t + offset for t in ids]


class PrefixCache(Protocol):
    """A token-id prefix cache whose nodes own KV slots. Slots it holds are either evictable
    (no running request locks them) or protected."""

    shares_prefixes: bool  # False: nothing is kept or shared (a request's KV stays its own)
    # (kind, token path, start[, medium]): see KVEvent; a cache without tiers leaves medium out.
    on_event: Callable[..., None] | None

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, object]:
        """Longest cached prefix of key: its slots, and the node to lock for it."""

    def insert(self, key: list[int], value: torch.Tensor, priority: int | None = None) -> int:
        """Offer key -> value slots. Returns n: the cache now owns value[n:]; value[:n] are the
        caller's, duplicates of what the cache already had (or, kept nothing, simply not kept)."""

    def inc_lock_ref(self, node: object) -> None: ...

    def dec_lock_ref(self, node: object) -> None: ...

    def record_hit(self, node: object, priority: int | None = None) -> None:
        """An admitted request uses the prefix ending at node (eviction policies read this)."""

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots of unlocked entries to the allocator, in the eviction
        policy's order (`radix_eviction_policy`)."""

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def total_tokens(self) -> int: ...

    def leaf_paths(self) -> list[list[int]]: ...


def request_priority(req: Req) -> int:
    """The request's priority (vLLM's convention: lower value = more important; default 0)."""
    return req.priority


class CacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 share_prefixes: bool = True, hicache: HiCacheConfig | None = None,
                 kv_cache: KVCache | None = None, model_id: str = "", hidden_size: int = 0) -> None:
        """hicache None: the radix cache with the default eviction policy (or no cache). Otherwise its eviction
        policy, and with enable_hierarchical_cache the host (and storage) tiers, which copy KV in
        and out of `kv_cache` (the device pool); `model_id` names the weights in storage keys and
        `hidden_size` fits the cost_aware policy to the model."""
        self.req_to_token_pool = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.allocator = allocator
        self.hidden_size = hidden_size
        self.tree: PrefixCache = (RadixCache(allocator, create_eviction_policy(DEFAULTS.radix_eviction_policy, hidden_size))
                                  if share_prefixes else NoRadixCache(allocator))
        self.hicache: HiRadixCache | None = None
        self.host_mirrored = False  # other ranks make the host tier's copies (tensor parallelism)
        self._subscribers: list[tuple[Callable[[KVEvent], None], frozenset[str]]] = []
        # A LoRA adapter load's id -> its name (the scheduler sets it when LoRA is on): KV events
        # name the adapter of a namespaced path.
        self.lora_name_of: Callable[[int], str | None] | None = None
        # Per request, the tokens of its last match that were loaded from the host tier and, of
        # those, from storage: counted per tier when its prefill starts (`_admitted`).
        self._loaded: weakref.WeakKeyDictionary[Req, tuple[int, int]] = weakref.WeakKeyDictionary()
        if hicache is not None and share_prefixes:
            self._build(hicache, kv_cache, model_id)

    def configure_cache(self, config: HiCacheConfig, kv_cache: KVCache | None = None, model_id: str = "") -> None:
        """Rebuild the prefix cache from `config` (eviction policy; tiers with
        enable_hierarchical_cache, which need `kv_cache`). Only with no request running: what the
        old cache held is freed. Not when other ranks mirror the host tier (`host_mirrored`)."""
        if self.host_mirrored:
            raise ConfigError("the cache of a tensor-parallel engine cannot be rebuilt (its ranks' host tiers follow it)")
        self.check_idle()
        if not self.tree.shares_prefixes:
            return
        self.tree.evict(self.allocator.size)
        self.close()
        on_event = self.tree.on_event
        self._build(config, kv_cache, model_id)
        self.tree.on_event = on_event
        if self.hicache is not None:
            self.hicache.tier_events = self._tier_events()

    def _build(self, config: HiCacheConfig, kv_cache: KVCache | None, model_id: str) -> None:
        if config.enable_hierarchical_cache:
            if kv_cache is None:
                raise ValueError("enable_hierarchical_cache needs the device KV pool (kv_cache)")
            self.hicache = HiRadixCache(self.allocator, kv_cache, config, model_id, self.hidden_size)
            self.tree = self.hicache
        else:
            self.hicache = None
            policy = create_eviction_policy(config.radix_eviction_policy, self.hidden_size)
            self.tree = RadixCache(self.allocator, policy)

    # ---- budget ----------------------------------------------------------------------------
    @property
    def total_size(self) -> int:
        return self.allocator.size

    def available_size(self) -> int:
        """Slots an allocation can get now: free ones plus what eviction can free."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def free_size(self) -> int:
        """Slots an allocation can get without evicting anything from the cache."""
        return self.allocator.available_size()

    def used_size(self) -> int:
        """Slots held by requests (running, or their locked prefixes)."""
        return self.allocator.size - self.available_size()

    def cached_size(self) -> int:
        return self.tree.evictable_size() + self.tree.protected_size()

    # ---- prefix matching and locks (prefill admission) -----------------------------------
    def match_prefix(self, req: Req) -> None:
        """Match the cache, leaving at least one token to compute (its logits are needed). A
        request that needs every prompt position's logits matches nothing."""
        fill = req.fill_ids
        key = [] if req.needs_prompt_logits else lora_key(req, fill[:len(fill) - 1])
        if self.hicache is not None:
            # The host (and storage) part is loaded into device slots now; the tree holds them
            # (evictable until the request is admitted and locks them), so the budget is unchanged.
            req.prefix_indices, req.last_node, host, storage = self.hicache.match_and_load(key)
            self._loaded[req] = (host, storage)
        else:
            req.prefix_indices, req.last_node = self.tree.match_prefix(key)
        req.extend_input_len = len(fill) - len(req.prefix_indices)

    def lock(self, req: Req) -> int:
        """Protect the request's matched prefix; returns how many slots left the budget."""
        before = self.tree.evictable_size()
        self.tree.inc_lock_ref(req.last_node)
        req.cache_protected_len = len(req.prefix_indices)
        return before - self.tree.evictable_size()

    def unlock(self, req: Req) -> None:
        self.tree.dec_lock_ref(req.last_node)

    # ---- allocation ------------------------------------------------------------------------
    def alloc_slots(self, n: int) -> torch.Tensor:
        if self.hicache is not None:  # the requests of earlier matches are admitted (locked) or will match again
            self.hicache.end_match_round()
        if self.allocator.available_size() < n:
            self.tree.evict(n - self.allocator.available_size())
        slots = self.allocator.alloc(n)
        if slots is None:
            raise OutOfKVError(f"need {n} KV slots, {self.allocator.available_size()} free after eviction")
        return slots

    def alloc_extend(self, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        """One slot per new token; a request row for each new request; writes
        req_to_token[row, :prefix] (the matched prefix) and [row, prefix:prefix + n]."""
        out_cache_loc = self.alloc_slots(sum(extend_lens))
        pool, offset = self.req_to_token_pool, 0
        try:
            for r, p, n in zip(reqs, prefix_lens, extend_lens):
                if r.req_pool_idx is None:
                    r.req_pool_idx = pool.alloc()
                    if r.req_pool_idx is None:
                        raise OutOfKVError("no free request row")
                    pool.write(r.req_pool_idx, 0, r.prefix_indices)
                    self._admitted(r)
                pool.write(r.req_pool_idx, p, out_cache_loc[offset:offset + n])
                r.kv_len = p + n
                offset += n
        except BaseException:  # slots no request row records yet would leak
            self.allocator.free(out_cache_loc[offset:])
            raise
        return out_cache_loc

    def _admitted(self, req: Req) -> None:
        """A request starts its prefill on its matched prefix: a hit for the eviction policies,
        and its prefix's tokens counted per tier they came from."""
        if req.last_node is not None:
            self.tree.record_hit(req.last_node, request_priority(req))
        if self.hicache is not None:
            host, storage = self._loaded.pop(req, (0, 0))
            tiers = self.hicache.tiers
            tiers["device"].hit_tokens += len(req.prefix_indices) - host
            tiers["host"].hit_tokens += host - storage
            tiers["storage"].hit_tokens += storage

    def alloc_decode(self, reqs: list[Req], rows: torch.Tensor, old_lens: torch.Tensor) -> torch.Tensor:
        """One slot per sequence, written at req_to_token[row, old_len]."""
        out_cache_loc = self.alloc_slots(len(reqs))
        try:
            self.req_to_token[rows, old_lens] = out_cache_loc.to(torch.int32)
        except BaseException:  # not recorded in any row: give the slots back
            self.allocator.free(out_cache_loc)
            raise
        for r in reqs:
            r.kv_len += 1
        return out_cache_loc

    def truncate(self, req: Req, kv_len: int) -> None:
        """Keep the request's first kv_len tokens of KV; the slots after them (rejected draft
        tokens) go back to the pool at once, never into the cache."""
        if kv_len < req.kv_len:
            self.allocator.free(self.req_to_token[req.req_pool_idx, kv_len:req.kv_len].to(torch.int64))
            req.kv_len = kv_len

    def kv_indices(self, req: Req) -> torch.Tensor:
        """The slots of the request's stored KV, in token order."""
        return self.req_to_token[req.req_pool_idx, :req.kv_len].to(torch.int64)

    # ---- a request's KV when it ends or pauses ----------------------------------------------
    def _insert(self, req: Req) -> torch.Tensor:
        """Offer the request's computed KV to the cache; free its duplicates of cached slots."""
        slots = self.kv_indices(req)
        have = self.tree.insert(lora_key(req, req.fill_ids[:req.kv_len]), slots, request_priority(req))
        if have > req.cache_protected_len:
            self.allocator.free(slots[req.cache_protected_len:have])
        return slots

    def cache_finished_req(self, req: Req) -> None:
        """The request ended (or was retracted): its KV goes to the cache, its row is freed."""
        self._insert(req)
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.release_kv_state()

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk (or its first token): cache what is computed and lock the
        request on it, so requests sharing it hit at once and it is never evicted under it."""
        if not self.tree.shares_prefixes:  # it keeps its own slots as the next chunk's prefix
            req.prefix_indices, req.cache_protected_len = self.kv_indices(req), 0
            return
        self._insert(req)
        new_indices, new_node = self.tree.match_prefix(lora_key(req, req.fill_ids[:req.kv_len]))
        start = req.cache_protected_len
        self.req_to_token_pool.write(req.req_pool_idx, start, new_indices[start:])
        self.tree.inc_lock_ref(new_node)
        self.tree.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node, req.cache_protected_len = new_indices, new_node, len(new_indices)

    def release_req(self, req: Req) -> None:
        """End a failed request without caching: its newest KV may be garbage. Frees the slots
        it owns (past the cache's locked prefix), unlocks the prefix, frees the row."""
        if req.req_pool_idx is not None:
            own = self.req_to_token[req.req_pool_idx, req.cache_protected_len:req.kv_len]
            self.allocator.free(own.to(torch.int64))
            self.req_to_token_pool.free(req.req_pool_idx)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.release_kv_state()

    # ---- KV events ---------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[KVEvent], None], mediums: tuple[str, ...] = ("device",)) -> None:
        """callback(KVEvent) on the step thread for every store and eviction from now on, in the
        tiers `mediums` (the device pool only by default; `MEDIUMS` for every tier). "queued" and
        "done" events go to every subscriber."""
        unknown = set(mediums) - set(MEDIUMS)
        if unknown:
            raise ValueError(f"unknown KV event mediums {sorted(unknown)}; known: {MEDIUMS}")
        self._subscribers.append((callback, frozenset(mediums)))
        self.tree.on_event = self._publish_path  # paths are computed only once someone listens
        if self.hicache is not None:
            self.hicache.tier_events = self._tier_events()

    def _tier_events(self) -> bool:
        return any(mediums - {"device"} for _, mediums in self._subscribers)

    def publish(self, kind: str, token_ids: list[int], start: int = 0, lora_name: str | None = None) -> None:
        """Send an event to the subscribers (none: nothing is built)."""
        if self._subscribers:
            self._publish(kind, token_ids, start, lora_name=lora_name)

    def _publish_path(self, kind: str, key: list[int], start: int, medium: str = "device") -> None:
        """A tree's event: a LoRA namespace's key goes out as token ids and the adapter's name."""
        lora_id = key[0] // LORA_KEY_SHIFT if key else 0
        if not lora_id:
            self._publish(kind, key, start, medium)
            return
        name = self.lora_name_of(lora_id) if self.lora_name_of is not None else None
        offset = lora_id * LORA_KEY_SHIFT
        self._publish(kind, [t - offset for t in key], start, medium, name or f"lora-{lora_id}")

    def _publish(self, kind: str, token_ids: list[int], start: int, medium: str = "device",
                 lora_name: str | None = None) -> None:
        event = None
        for callback, mediums in self._subscribers:
            if medium in mediums or kind in ("queued", "done"):
                if event is None:
                    event = KVEvent(kind, token_ids, start, medium, lora_name)
                callback(event)

    def snapshot(self, medium: str = "device") -> list[list[int]]:
        """Every token path the cache holds in tier `medium` ("device" or "host"; its leaves'
        paths), for a subscriber that resyncs. The storage tier is shared: no engine lists it.
        Base-model paths only: LoRA adapters' KV is announced by events alone."""
        if medium == "device":
            paths = self.tree.leaf_paths()
        else:
            paths = self.hicache.host_leaf_paths() if self.hicache is not None else []
        return [p for p in paths if not p or p[0] < LORA_KEY_SHIFT]

    # ---- integrity ---------------------------------------------------------------------------
    def check_idle(self) -> None:
        """Idle invariant (no request running): every slot is free or in the cache, nothing is
        locked, and every request row is free."""
        available, evictable = self.allocator.available_size(), self.tree.evictable_size()
        protected, total = self.tree.protected_size(), self.allocator.size
        if available + evictable + protected != total:
            raise MemoryInvariantError(f"KV leak: available {available} + evictable {evictable} + protected "
                                       f"{protected} != total {total}")
        if protected:
            raise MemoryInvariantError(f"{protected} slots still locked with no request running")
        pool = self.req_to_token_pool
        if pool.available_size() != pool.size:
            raise MemoryInvariantError(f"request rows leaked: {pool.size - pool.available_size()}")
        if self.hicache is not None:
            self.hicache.check_host()

    # ---- the hierarchical cache ----------------------------------------------------------------
    def hicache_stats(self) -> HiCacheStats | None:
        """Per-tier hits (prompt tokens admitted from each tier), bytes moved, load times; None
        without the hierarchical cache."""
        return self.hicache.stats() if self.hicache is not None else None

    def close(self) -> None:
        """At shutdown: flush the storage tier's pending writes."""
        if self.hicache is not None:
            self.hicache.close()
