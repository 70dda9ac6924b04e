"""HiCacheConfig: the hierarchical cache's settings, with SGLang's names (phase 2 moves them into
EngineConfig). Passed to CacheManager; None there means the plain radix cache with LRU."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from engine.errors import ConfigError
from engine.hicache.eviction import EVICTION_POLICIES

WritePolicy = Literal["write_through", "write_back", "write_through_selective"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
WRITE_POLICIES = get_args(WritePolicy)
PREFETCH_POLICIES = get_args(PrefetchPolicy)


class HiCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Keep KV evicted from the device pool in a host-memory tier (and, with a storage backend,
    # below it) instead of dropping it; a match ending there loads it back before the prefill.
    enable_hierarchical_cache: bool = False
    # Host tier capacity as a multiple of the device KV pool's tokens (unless hicache_size is set).
    hicache_ratio: float = 2.0
    # Host tier capacity in GB (1e9 bytes) of KV; 0: use hicache_ratio.
    hicache_size: float = 0.0
    # When device KV is copied to the host tier: write_through (at insert), write_back (when
    # evicted from the device), write_through_selective (once a node was used by two admissions).
    hicache_write_policy: WritePolicy = "write_through"
    # Storage tier below the host tier, shared by engines ("file"; the actor layer registers more);
    # None: no storage tier. Needs enable_hierarchical_cache.
    hicache_storage_backend: str | None = None
    # The file backend's directory (a shared file system for a fleet).
    hicache_storage_path: str | None = None
    # Tokens per storage page; a prefix's last partial page is not stored.
    hicache_storage_page_size: int = 64
    # How a match waits for storage pages: wait_complete (load them before returning),
    # timeout (wait up to hicache_storage_prefetch_timeout_s, use what arrived), best_effort
    # (start a background prefetch, use what is ready; later matches pick up the rest).
    hicache_storage_prefetch_policy: PrefetchPolicy = "wait_complete"
    # The timeout policy's wait per match, in seconds.
    hicache_storage_prefetch_timeout_s: float = 1.0
    # Which unlocked radix nodes are evicted first, in every tier: lru, lfu, slru, priority
    # (the request's priority, lower value kept longer), cost_aware (recompute cost per slot).
    radix_eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(
                f"radix_eviction_policy must be one of {sorted(EVICTION_POLICIES)}, "
                f"got {self.radix_eviction_policy!r}"
            )
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ConfigError(f"hicache_write_policy must be one of {WRITE_POLICIES}")
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(f"hicache_storage_prefetch_policy must be one of {PREFETCH_POLICIES}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ConfigError("hicache_ratio must be > 0 and hicache_size >= 0")
        if self.hicache_storage_page_size < 1:
            raise ConfigError("hicache_storage_page_size must be >= 1")
        if self.hicache_storage_prefetch_timeout_s < 0:
            raise ConfigError("hicache_storage_prefetch_timeout_s must be >= 0")
        if self.hicache_storage_backend is not None:
            if not self.enable_hierarchical_cache:
                raise ConfigError("hicache_storage_backend needs enable_hierarchical_cache")
            if self.hicache_storage_backend == "file" and not self.hicache_storage_path:
                raise ConfigError("hicache_storage_backend 'file' needs hicache_storage_path")
