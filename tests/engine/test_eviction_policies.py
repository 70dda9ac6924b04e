"""Eviction policies (engine/hicache/eviction.py): each keeps the radix cache's invariants under
random operation sequences, LRU evicts exactly as the cache always did, and each orders victims as
it says (lfu, slru, priority with vLLM's convention, cost_aware)."""

from __future__ import annotations

import heapq

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache_manager import CacheManager
from engine.hicache.config import HiCacheConfig
from engine.hicache.eviction import EVICTION_POLICIES, EvictionPolicy, create_eviction_policy
from engine.memory import ReqToTokenPool, TokenToKVPoolAllocator
from engine.radix_cache import RadixCache
from engine.req import Req
from engine.sampling import SamplingParams
from tests.engine.test_radix_cache import longest_cached_prefix
from tests.helpers import tree_paths

POOL = 120
DEV = torch.device("cpu")
POLICIES = sorted(EVICTION_POLICIES)

keys = st.lists(st.integers(0, 3), min_size=1, max_size=12)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), keys, st.integers(-2, 2)),
        st.tuples(st.just("match"), keys, st.just(0)),
        st.tuples(st.just("lock"), keys, st.integers(-2, 2)),
        st.tuples(st.just("unlock"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("evict"), st.integers(1, 20), st.just(0)),
    ),
    max_size=60,
)


def test_registry_names_and_errors():
    assert set(POLICIES) == {"lru", "lfu", "slru", "priority", "cost_aware"}
    for name in POLICIES:
        policy = create_eviction_policy(name)
        assert isinstance(policy, EvictionPolicy) and policy.name == name
    with pytest.raises(ValueError, match="known"):
        create_eviction_policy("mru")
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        HiCacheConfig(radix_eviction_policy="nope")
    # Fitted to the model: cost_aware's attention/linear crossover is 6 x hidden_size.
    assert create_eviction_policy("cost_aware", hidden_size=1024).attention_tokens == 6144
    assert create_eviction_policy("cost_aware").attention_tokens == 8192.0  # unknown model
    assert create_eviction_policy("lru", hidden_size=1024).name == "lru"


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None)
@given(script=ops)
def test_every_policy_keeps_the_radix_invariants(name, script):
    alloc = TokenToKVPoolAllocator(POOL, DEV)
    cache = RadixCache(alloc, create_eviction_policy(name))
    stored: set[tuple[int, ...]] = set()
    slot_of: dict[tuple, int] = {}
    locks = []
    for op, arg, prio in script:
        if op == "insert":
            slots = alloc.alloc(len(arg))
            if slots is None:
                continue
            have = cache.insert(arg, slots, prio)
            assert have == longest_cached_prefix(dict.fromkeys(stored, 1), arg)
            alloc.free(slots[:have])
            for i in range(have, len(arg)):
                slot_of[tuple(arg[: i + 1])] = int(slots[i])
            stored.add(tuple(arg))
        elif op in ("match", "lock"):
            idx, node = cache.match_prefix(arg)
            n = longest_cached_prefix(dict.fromkeys(stored, 1), arg)
            assert idx.tolist() == [slot_of[tuple(arg[: i + 1])] for i in range(n)]
            if op == "lock" and n:
                cache.inc_lock_ref(node)
                cache.record_hit(node, prio)
                locks.append(node)
        elif op == "unlock" and locks:
            cache.dec_lock_ref(locks.pop(arg % len(locks)))
        elif op == "evict":
            before = cache.evictable_size()
            freed = cache.evict(arg)
            # Frees what was asked when the unlocked part allows it, and only unlocked slots.
            assert freed >= min(arg, before) and freed <= before
            stored = tree_paths(cache)
            for node in locks:
                assert node.lock_ref > 0
        assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == POOL
        assert cache.evictable_size() + cache.protected_size() == cache.total_tokens()
    for node in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.evict(POOL)
    assert alloc.available_size() == POOL
    alloc.check_no_duplicates()


def legacy_lru_evict(cache: RadixCache, num_tokens: int) -> int:
    """The cache's eviction before policies existed (a heap of nodes ordered by last_access)."""
    heap = [n for n in cache._nodes() if not n.children and n.lock_ref == 0]
    heapq.heapify(heap)
    evicted = 0
    while heap and evicted < num_tokens:
        leaf = heapq.heappop(heap)
        cache.allocator.free(leaf.value)
        evicted += len(leaf.key)
        cache._evictable -= len(leaf.key)
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        if parent is not cache.root and not parent.children and parent.lock_ref == 0:
            heapq.heappush(heap, parent)
    return evicted


@settings(max_examples=80, deadline=None)
@given(ops)
def test_lru_default_evicts_exactly_as_before(script):
    trees = [RadixCache(TokenToKVPoolAllocator(POOL, DEV)) for _ in range(2)]
    locks: list[list] = [[], []]
    for op, arg, _ in script:
        for i, cache in enumerate(trees):
            if op == "insert":
                slots = cache.allocator.alloc(len(arg))
                if slots is not None:
                    cache.allocator.free(slots[: cache.insert(arg, slots)])
            elif op in ("match", "lock"):
                _, node = cache.match_prefix(arg)
                if op == "lock" and node is not cache.root:
                    cache.inc_lock_ref(node)
                    locks[i].append(node)
            elif op == "unlock" and locks[i]:
                cache.dec_lock_ref(locks[i].pop(arg % len(locks[i])))
            elif op == "evict":
                (cache.evict if i == 0 else lambda n, c=cache: legacy_lru_evict(c, n))(arg)
        assert tree_paths(trees[0]) == tree_paths(trees[1])
        assert trees[0].allocator.available_size() == trees[1].allocator.available_size()


def _cache_with(policy: str, pool: int = 64) -> RadixCache:
    return RadixCache(TokenToKVPoolAllocator(pool, DEV), create_eviction_policy(policy))


def _put(cache: RadixCache, key: list[int], priority: int | None = None):
    slots = cache.allocator.alloc(len(key))
    cache.allocator.free(slots[: cache.insert(key, slots, priority)])
    return cache.match_prefix(key)[1]


def _hit(cache: RadixCache, key: list[int], times: int = 1, priority: int | None = None) -> None:
    _, node = cache.match_prefix(key)
    for _ in range(times):
        cache.record_hit(node, priority)


def test_lfu_and_slru_keep_the_reused_prefix():
    for name in ("lfu", "slru"):
        cache = _cache_with(name)
        _put(cache, [1, 1, 1])
        _hit(cache, [1, 1, 1], times=3)  # reused, but least recent below
        _put(cache, [2, 2, 2])
        _put(cache, [3, 3, 3])
        cache.evict(3)
        assert tree_paths(cache) == {(1, 1, 1), (3, 3, 3)}, name
    lru = _cache_with("lru")
    _put(lru, [1, 1, 1])
    _put(lru, [2, 2, 2])
    lru.evict(3)
    assert tree_paths(lru) == {(2, 2, 2)}


def test_priority_follows_vllm_lower_value_is_kept():
    cache = _cache_with("priority")
    _put(cache, [1, 1], priority=0)
    _put(cache, [2, 2], priority=5)  # least important (highest value): evicted first
    _put(cache, [3, 3], priority=-1)
    _put(cache, [4, 4], priority=0)
    cache.evict(2)
    assert tree_paths(cache) == {(1, 1), (3, 3), (4, 4)}
    cache.evict(2)  # equal priorities: least recent first
    assert tree_paths(cache) == {(3, 3), (4, 4)}
    # A node keeps the most important priority of its users.
    _hit(cache, [4, 4], priority=-3)
    cache.evict(2)
    assert tree_paths(cache) == {(4, 4)}


def test_cost_aware_keeps_deep_prefixes_and_ages_out():
    cache = _cache_with("cost_aware", pool=2000)
    cache.policy.attention_tokens = 16.0  # a small model: attention dominates early
    deep = [7] * 400 + [8] * 10
    _put(cache, deep)
    _put(cache, [9] * 10)  # as long, as recent, but shallow: cheap to recompute
    _, node = cache.match_prefix(deep)
    assert node.depth == 0 and len(node.key) == 410
    _put(cache, [7] * 400 + [6] * 10)  # splits: the deep tail [8]*10 sits at depth 400
    tails = {tuple(n.key[:1]): n for n in cache._nodes() if not n.children}
    assert tails[(8,)].depth == 400 and tails[(6,)].depth == 400
    cache.match_prefix(deep)  # the deep tail is the more recent of the two leaves here
    cache.evict(10)
    assert (9,) * 10 not in tree_paths(cache)  # the shallow leaf went first
    # Idle time wins in the end: ticks with no use of the deep tail let the other one outlive it.
    for _ in range(50):
        cache.match_prefix([7] * 400 + [6] * 10)
    cache.evict(10)
    assert tuple([7] * 400 + [8] * 10) not in tree_paths(cache)


def test_cache_manager_uses_the_configured_policy_and_request_priority():
    greedy = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    cm = CacheManager(
        ReqToTokenPool(4, 32, DEV),
        TokenToKVPoolAllocator(16, DEV),
        hicache=HiCacheConfig(radix_eviction_policy="priority"),
    )
    assert cm.hicache is None and cm.tree.policy.name == "priority"
    for i, prio in enumerate([3, 0, 1]):
        req = Req(f"r{i}", [10 * (i + 1)] * 5, greedy)
        req.priority = prio
        cm.match_prefix(req)
        cm.lock(req)
        cm.alloc_extend([req], [0], [5])
        cm.cache_finished_req(req)
    cm.alloc_slots(3)  # 15 cached + 3 > 16: one node goes, the priority-3 one
    assert sorted(cm.snapshot()) == [[20] * 5, [30] * 5]
    default = CacheManager(ReqToTokenPool(4, 32, DEV), TokenToKVPoolAllocator(16, DEV))
    assert default.hicache is None and default.tree.policy.name == "cost_aware"
