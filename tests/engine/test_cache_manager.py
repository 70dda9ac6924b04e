"""CacheManager: KV events, the budget in one place, a request's KV at its end, the idle
invariant; and the step loop's strategy hook."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, MemoryInvariantError, SamplingParams
from engine.cache_manager import CacheManager, KVEvent
from engine.hicache.config import HiCacheConfig
from engine.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from engine.req import Req
from engine.scheduler import StepStrategy

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def _manager(slots: int = 64, share: bool = True) -> CacheManager:
    return CacheManager(ReqToTokenPool(4, 32, CPU), TokenToKVPoolAllocator(slots, CPU), share_prefixes=share)


def _prefilled(cache: CacheManager, ids: list[int]) -> Req:
    """A request whose prompt was matched, admitted and computed (as the scheduler does)."""
    req = Req("r", ids, GREEDY)
    cache.match_prefix(req)
    cache.lock(req)
    cache.alloc_extend([req], [len(req.prefix_indices)], [req.extend_input_len])
    return req


def test_events_report_what_the_cache_stores_and_evicts():
    cache = _manager(slots=16)
    events: list[KVEvent] = []
    cache.subscribe(events.append)
    a = _prefilled(cache, [1, 2, 3, 4, 5])
    cache.cache_finished_req(a)
    b = _prefilled(cache, [1, 2, 3, 9])  # shares [1, 2, 3]; only [9] is new
    cache.cache_finished_req(b)
    assert events == [KVEvent("stored", [1, 2, 3, 4, 5], 0), KVEvent("stored", [1, 2, 3, 9], 3)]
    assert cache.available_size() == 16 and cache.cached_size() == 6
    assert sorted(cache.snapshot()) == [[1, 2, 3, 4, 5], [1, 2, 3, 9]]
    cache.alloc_slots(16)  # needs every slot: the whole tree is evicted, leaves first
    assert [e.kind for e in events[2:]] == ["removed"] * 3
    assert {(tuple(e.token_ids), e.start) for e in events[2:]} == {((1, 2, 3, 4, 5), 3), ((1, 2, 3, 9), 3),
                                                                   ((1, 2, 3), 0)}
    assert cache.snapshot() == []


def test_events_follow_the_device_view_with_a_host_tier():
    """With the host tier an eviction still says "removed" (the pool no longer holds it) and a
    load-back says "stored" again, from the end of the part the pool kept."""
    kv = KVCache(16, 1, 1, 2, torch.float32, CPU)
    cache = _manager(slots=16)
    events: list[KVEvent] = []
    cache.subscribe(events.append)
    cache.configure_cache(HiCacheConfig(enable_hierarchical_cache=True), kv)  # subscribers stay
    cache.cache_finished_req(_prefilled(cache, [1, 2, 3, 4, 5]))
    cache.cache_finished_req(_prefilled(cache, [1, 2, 3, 9]))
    assert events == [KVEvent("stored", [1, 2, 3, 4, 5], 0), KVEvent("stored", [1, 2, 3, 9], 3)]
    cache.allocator.free(cache.alloc_slots(16))  # everything leaves the pool, none of it the host
    assert [e.kind for e in events[2:]] == ["removed"] * 3 and cache.snapshot() == []
    assert cache.hicache.host_tokens() == 6
    req = _prefilled(cache, [1, 2, 3, 4, 5, 6])  # [1..5] loaded back from the host
    assert len(req.prefix_indices) == 5 and events[-1] == KVEvent("stored", [1, 2, 3, 4, 5], 0)
    cache.cache_finished_req(req)
    cache.check_idle()
    assert cache.hicache_stats().host.hit_tokens == 5


def test_configure_cache_needs_an_idle_cache():
    cache = _manager(slots=16)
    req = _prefilled(cache, [1, 2, 3])
    with pytest.raises(MemoryInvariantError):
        cache.configure_cache(HiCacheConfig(radix_eviction_policy="lfu"))
    cache.cache_finished_req(req)
    cache.configure_cache(HiCacheConfig(radix_eviction_policy="lfu"))  # what it held is freed
    assert cache.tree.policy.name == "lfu" and cache.available_size() == 16 and cache.cached_size() == 0


def test_budget_and_idle_invariant():
    cache = _manager(slots=32)
    req = _prefilled(cache, list(range(1, 11)))
    assert cache.used_size() == 10 and cache.available_size() == 22
    with pytest.raises(MemoryInvariantError, match="locked|leak|rows"):
        cache.check_idle()  # a request still holds its KV
    cache.cache_finished_req(req)
    cache.check_idle()
    assert cache.available_size() == 32 and cache.cached_size() == 10


def test_release_frees_without_caching_and_no_radix_keeps_nothing():
    cache = _manager(slots=32)
    warm = _prefilled(cache, [1, 2, 3, 4])
    cache.cache_finished_req(warm)
    failed = _prefilled(cache, [1, 2, 3, 4, 7, 8])  # its prefix [1, 2, 3, 4] comes from the cache
    assert len(failed.prefix_indices) == 4
    cache.release_req(failed)
    cache.check_idle()
    assert cache.cached_size() == 4  # nothing of the failed request was cached

    plain = _manager(slots=32, share=False)
    req = _prefilled(plain, [1, 2, 3, 4])
    plain.cache_unfinished_req(req)  # keeps its own slots as its prefix
    assert req.prefix_indices.tolist() == plain.kv_indices(req).tolist()
    plain.cache_finished_req(req)
    plain.check_idle()
    assert plain.cached_size() == 0 and plain.available_size() == 32


def test_a_step_strategy_sees_every_batch_before_its_forward(model_dirs):
    """The sync hook between scheduling and the forward (attention-DP agrees on counts there)."""

    class Recording(StepStrategy):
        def __init__(self) -> None:
            self.modes: list[str] = []

        def sync(self, sched, batch, touched):
            if batch is not None:
                self.modes.append(batch.forward_mode.name)
            return batch

    eng = Engine(model_path=model_dirs["llama"], max_total_tokens=256)
    eng.strategy = rec = Recording()
    ref = Engine(model_path=model_dirs["llama"], max_total_tokens=256)
    out = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert out.token_ids == ref.generate(input_ids=[5, 6, 7], sampling_params=GREEDY).token_ids
    assert rec.modes == ["EXTEND"] + ["DECODE"] * 3
    eng.check_memory()
