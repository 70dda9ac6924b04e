"""The routing index against the engine's real radix cache: fed only the cache's KV events, it
matches every prompt exactly as the cache does; a lost event is detected and a snapshot resyncs."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.protocol import KVEventBatch, KVSnapshot
from cluster.kv_index import CachedPaths, InFlightPrompts, KVIndex
from cluster.routing import Router
from engine import SamplingParams
from engine.cache_manager import CacheManager, KVEvent
from engine.errors import ConfigError
from engine.memory import ReqToTokenPool, TokenToKVPoolAllocator
from engine.req import Req

CPU = torch.device("cpu")
tokens = st.lists(st.integers(1, 4), min_size=1, max_size=12)
ops = st.lists(st.tuples(st.sampled_from(["add", "evict", "query"]), tokens, st.integers(1, 20)), max_size=40)


def _run(cache: CacheManager, ids: list[int]) -> None:
    """One request through the cache as the scheduler drives it: match, lock, compute, finish."""
    req = Req("r", ids, SamplingParams(max_new_tokens=1))
    cache.match_prefix(req)
    cache.lock(req)
    cache.alloc_extend([req], [len(req.prefix_indices)], [req.extend_input_len])
    cache.cache_finished_req(req)


def _cached_len(cache: CacheManager, ids: list[int]) -> int:
    return len(cache.tree.match_prefix(ids)[0])


@settings(max_examples=150, deadline=None)
@given(ops)
def test_events_keep_the_index_exact(script):
    cache = CacheManager(ReqToTokenPool(2, 16, CPU), TokenToKVPoolAllocator(40, CPU))
    events: list[KVEvent] = []
    cache.subscribe(events.append)
    paths = CachedPaths()
    for op, ids, n in script:
        if op == "add" and len(ids) <= cache.available_size():
            _run(cache, ids)
        elif op == "evict":
            cache.tree.evict(n)
        for e in events:
            paths.insert(e.token_ids) if e.kind == "stored" else paths.remove(e.token_ids, e.start)
        events.clear()
        assert paths.match(ids) == _cached_len(cache, ids)
        assert paths.size == cache.cached_size()


def _batch(first: int, *events: KVEvent, incarnation: str = "a") -> KVEventBatch:
    return KVEventBatch(incarnation, first, list(events))


def test_a_gap_makes_the_engine_stale_until_a_snapshot():
    index = KVIndex(2)
    assert index.match(0, [1, 2, 3]) == 0  # nothing known yet
    assert index.apply(0, _batch(1, KVEvent("stored", [1, 2, 3], 0)))
    assert index.match(0, [1, 2, 3, 4]) == 3 and index.match(1, [1, 2, 3]) == 0
    # Event 2 is lost: event 3 reveals the gap, and the engine matches nothing until resynced.
    assert not index.apply(0, _batch(3, KVEvent("stored", [7, 8], 0)))
    assert index.match(0, [1, 2, 3]) == 0
    assert not index.apply(0, _batch(4, KVEvent("stored", [9], 0)))
    index.reset(0, KVSnapshot("a", 4, [[1, 2], [7, 8], [9]]))
    assert index.match(0, [1, 2, 3]) == 2 and index.match(0, [7, 8]) == 2
    assert index.apply(0, _batch(3, KVEvent("stored", [7, 8], 0), KVEvent("stored", [9], 0),
                                 KVEvent("removed", [9], 0)))  # 3 and 4 are in the snapshot
    assert index.match(0, [9]) == 0 and index.resyncs[0] == 1


def test_a_restarted_engine_starts_over():
    index = KVIndex(1)
    index.apply(0, _batch(1, KVEvent("stored", [1, 2, 3], 0)))
    assert index.apply(0, _batch(1, KVEvent("stored", [5], 0), incarnation="b"))  # new instance, from 1
    assert index.match(0, [1, 2, 3]) == 0 and index.match(0, [5]) == 1
    assert not index.apply(0, _batch(7, KVEvent("stored", [6], 0), incarnation="c"))  # joined mid-stream


def test_kv_events_policy_weighs_cached_tokens_against_load():
    router = Router("kv_events", 2, policy_options={"prefill_weight": 1.0, "load_weight": 0.1})
    prompt = list(range(1, 101))
    router.kv_index.apply(1, _batch(1, KVEvent("stored", prompt[:90], 0)))
    assert router.pick(prompt, cost=110) == 1  # 10 tokens to compute there instead of 100
    assert router.stats().prefix_hit_rate == 0.9
    # The prompt now in flight there counts as held: a second copy costs nothing to prefill.
    assert router.kv_index.match_with_in_flight(1, prompt) == 100
    for _ in range(10):  # engine 1 gets busy: 0.1 x 11 x 110 tokens in flight cost more than 100
        router.loads[1].requests += 1
        router.loads[1].tokens += 110
    assert router.pick(prompt, cost=110) == 0
    router.done(1, 110, prompt)
    assert router.kv_index.match_with_in_flight(1, prompt) == 90  # back to what the cache holds


def test_in_flight_prompts_are_counted():
    flight = InFlightPrompts()
    flight.add([1, 2, 3])
    flight.add([1, 2, 4])
    assert flight.match([1, 2, 3, 9]) == 3 and flight.match([1, 2, 9]) == 2
    flight.discard([1, 2, 3])
    assert flight.match([1, 2, 3]) == 2 and flight.match([1, 2, 4]) == 3
    flight.discard([1, 2, 4])
    assert flight.match([1, 2, 4]) == 0 and flight.root == {}


def test_queued_prompts_count_from_any_front_end_until_done():
    """An engine reports each request's prompt when it queues it and when it ends: every router
    follows the prefix there before the prefill stores it, whoever sent the request."""
    router = Router("kv_events", 2)
    prompt = list(range(1, 51))
    assert router.kv_index.apply(1, _batch(1, KVEvent("queued", prompt), KVEvent("queued", prompt)))
    assert router.kv_index.match(1, prompt) == 0  # nothing stored yet
    assert router.kv_index.match_with_in_flight(1, prompt) == 50 and router.kv_index.queued_tokens(1) == 100
    assert router.pick(prompt[:40] + [99], cost=41) == 1
    # Another front end's load counts too: 0.1 x 600 queued tokens there outweigh 10 to prefill.
    router.kv_index.apply(1, _batch(3, *[KVEvent("queued", [7] * 100)] * 5))
    assert router.pick(prompt[:40] + [98], cost=41) == 0
    router.done(0, 41, prompt[:40] + [98])
    router.kv_index.apply(1, _batch(8, *[KVEvent("done", [7] * 100)] * 5))
    router.kv_index.apply(1, _batch(13, KVEvent("stored", prompt), KVEvent("done", prompt), KVEvent("done", prompt)))
    assert router.kv_index.views[1].queued.root == {} and router.kv_index.match_with_in_flight(1, prompt) == 50
    # A snapshot carries the requests there at its seq; a stale engine's queue counts for nothing.
    router.kv_index.reset(0, KVSnapshot("b", 9, [], queued=[prompt[:20]]))
    assert router.kv_index.match_with_in_flight(0, prompt) == 20
    assert not router.kv_index.apply(0, _batch(11, KVEvent("done", prompt[:20]), incarnation="b"))  # a gap
    assert router.kv_index.match_with_in_flight(0, prompt) == 0


def _two_engines(capacity: int = 2200) -> Router:
    router = Router("kv_events", 0)
    for i in range(2):
        router.add_engine(capacity)
        router.kv_index.apply(i, _batch(1, incarnation=str(i)))  # in sync, empty
    return router


def test_kv_events_ties_go_to_the_engine_holding_less():
    """Sequential requests of new tenants: equal costs, so the engine whose cache holds less
    takes the next one, whatever its index."""
    router = _two_engines()
    seq = [1, 1]
    chosen = []
    for t in range(4):
        prompt = [100 * t + k for k in range(1, 401)]
        i = router.pick(prompt, 416)
        assert router.kv_index.apply(i, _batch(seq[i], KVEvent("stored", prompt), incarnation=str(i)))
        seq[i] += 1
        router.done(i, 416, prompt)
        chosen.append(i)
    assert sorted(chosen) == [0, 0, 1, 1]
    assert router.kv_index.cached_tokens(0) == router.kv_index.cached_tokens(1) == 800


def test_kv_events_weighs_what_a_new_prefix_would_evict():
    """Engine 0 holds 1,752 of its 2,200 tokens, among them a 16-token head the new prompt
    shares; engine 1 holds 400. Computing 16 more tokens on engine 1 beats pushing cached
    prefixes out of engine 0; with no eviction cost the shared head wins."""
    head = [1] * 16
    held = [head + [100 * t + k for k in range(434)] for t in range(1, 5)]  # 4 x 450 tokens
    new = head + [9000 + k for k in range(384)]
    for evict_weight, expected in ((1.0, 1), (0.0, 0)):
        router = _two_engines()
        router.policy.evict_weight = evict_weight
        assert router.kv_index.apply(0, _batch(1, *[KVEvent("stored", p) for p in held], incarnation="0"))
        assert router.kv_index.apply(1, _batch(1, KVEvent("stored", [5000 + k for k in range(400)]), incarnation="1"))
        assert router.kv_pressure([0, 1]) == pytest.approx({0: (1800 - 16 * 3 - 400) / 2200, 1: 0.0})
        assert router.pick(new, 400) == expected


def test_full_engines_keep_the_balance_of_cache_and_load():
    """Both pools full: no pressure difference, so the cost is prefill + load as before."""
    router = _two_engines(capacity=1000)
    prompt = list(range(1, 101))
    assert router.kv_index.apply(0, _batch(1, KVEvent("stored", prompt[:90] + [7] * 910), incarnation="0"))
    assert router.kv_index.apply(1, _batch(1, KVEvent("stored", [8] * 1000), incarnation="1"))
    assert router.kv_pressure([0, 1]) == {0: 0.0, 1: 0.0}
    assert router.pick(prompt, 110) == 0
    router.loads[0].tokens += 1100  # 0.1 x 1,100 > the 90 tokens it saves
    assert router.pick(prompt, 110) == 1


def test_kv_events_scores_host_and_storage_hits_between_a_pool_hit_and_a_recompute():
    """Tier-weighted scoring: a prompt in engine 0's host tier beats a recompute on engine 1 and
    loses to engine 1's pool; a prefix in the shared storage tier is available on every engine."""
    prompt = list(range(1, 101))
    router = Router("kv_events", 2, policy_options={"load_weight": 0.0, "evict_weight": 0.0})
    router.kv_index.apply(0, _batch(1, KVEvent("stored", prompt, 0, "host")))
    router.kv_index.apply(1, _batch(1, KVEvent("stored", [500], 0)))
    assert router.kv_index.match_tiers(0, prompt) == (0, 100, 100)
    assert router.pick(prompt, cost=0) == 0  # a load from the host instead of 100 tokens computed
    assert router.stats().prefix_hit_rate == 1.0  # held in a tier: loaded, not computed
    router.done(0, 0, prompt)
    router.kv_index.apply(1, _batch(2, KVEvent("stored", prompt[:60], 0)))
    # Engine 0: 100 host tokens x 0.1 = 10; engine 1: 40 recomputed = 40.
    assert router.pick(prompt, cost=0) == 0
    router.done(0, 0, prompt)
    router.kv_index.apply(1, _batch(3, KVEvent("stored", prompt[:95], 0)))
    assert router.pick(prompt, cost=0) == 1  # 5 recomputed beats 100 loaded from the host
    router.done(1, 0, prompt)
    # The host copy goes: engine 0 would recompute everything.
    router.kv_index.apply(0, _batch(2, KVEvent("removed", prompt, 0, "host")))
    assert router.kv_index.match_tiers(0, prompt) == (0, 0, 0)
    # Engine 1 wrote 96 tokens to the shared storage: engine 0 can load them too (96 x 0.3 + 4
    # recomputed = 32.8), engine 1 keeps its pool's 95 (5 recomputed): engine 1 still wins, but
    # a prompt engine 1's pool does not hold goes by storage on either engine.
    router.kv_index.apply(1, _batch(4, KVEvent("stored", prompt[:96], 64, "storage")))
    assert router.kv_index.match_tiers(0, prompt) == (0, 0, 96)
    assert router.pick(prompt, cost=0) == 1
    router.done(1, 0, prompt)
    assert router.kv_index.stats().storage_tokens == 96 and router.kv_index.stats().host_tokens == [0, 0]
    with pytest.raises(ConfigError, match="host_hit_weight"):
        Router("kv_events", 1, policy_options={"host_hit_weight": 2.0})


def test_a_snapshot_restores_the_host_tier_and_storage_is_bounded():
    index = KVIndex(1, storage_capacity=10)
    snap = KVSnapshot("a", 3, [[1, 2]])
    index.reset(0, snap)
    assert index.match_tiers(0, [1, 2, 3, 4]) == (2, 2, 2)  # a snapshot without host paths

    class WithHost(msgspec.Struct, frozen=True, array_like=True):  # what KVSnapshot would add
        incarnation: str
        seq: int
        paths: list[list[int]]
        queued: list[list[int]] = []
        host_paths: list[list[int]] = []

    index.reset(0, WithHost("a", 3, [[1, 2]], [], [[1, 2, 3, 4]]))
    assert index.match_tiers(0, [1, 2, 3, 4, 5]) == (2, 4, 4)
    index.apply(0, _batch(4, KVEvent("stored", list(range(20, 28)), 0, "storage"), incarnation="a"))
    assert index.match_tiers(0, list(range(20, 28))) == (0, 0, 8)
    index.apply(0, _batch(5, KVEvent("stored", list(range(40, 48)), 0, "storage"), incarnation="a"))
    assert index.storage.size == 0  # past its capacity the storage view starts over


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@settings(max_examples=60, deadline=None)
@given(script=st.lists(st.tuples(st.sampled_from(["add", "evict", "evict_host", "query"]), tokens,
                                 st.integers(1, 20)), max_size=40))
def test_tier_events_keep_the_host_view_exact(write_policy, script):
    """Fed the hierarchical cache's events of every tier, the index matches what its pool holds
    and what its host tier holds (a host copy's whole path: its head may be on the device only)."""
    from engine.cache_manager import MEDIUMS
    from engine.hicache.config import HiCacheConfig
    from engine.memory import KVCache
    from engine.token_trie import common_prefix_len

    cfg = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=1.5, hicache_write_policy=write_policy)
    cache = CacheManager(ReqToTokenPool(2, 16, CPU), TokenToKVPoolAllocator(20, CPU), hicache=cfg,
                         kv_cache=KVCache(20, 1, 1, 1, torch.float32, CPU))
    index, seq = KVIndex(1), [0]

    def on_event(event: KVEvent) -> None:
        seq[0] += 1
        assert index.apply(0, _batch(seq[0], event))

    cache.subscribe(on_event, MEDIUMS)
    hi = cache.hicache
    for op, ids, n in script:
        if op == "add":
            _run(cache, ids)
        elif op == "evict":
            hi.evict(n)
        elif op == "evict_host":
            hi.evict_host(n)
        device = len(hi.match_prefix(ids)[0])
        host_paths = [hi._path(node) for node in hi._nodes() if node.host_value is not None]
        host = max([device] + [common_prefix_len(ids, p) for p in host_paths])
        assert index.match_tiers(0, ids)[:2] == (device, host)
        cache.check_idle()
