"""Hierarchical KV cache (SGLang's HiCache): a host-memory tier under the device pool
(`host_pool.HostKVPool`), a radix tree that knows which tier holds each node
(`hiradix_cache.HiRadixCache`), a storage tier shared by engines (`storage`), the eviction policies
every radix tree uses (`eviction`) and the settings (`config.HiCacheConfig`).

Nothing is imported here: `engine.radix_cache` imports `engine.hicache.eviction`, and the
hierarchical tree imports `engine.radix_cache`."""
