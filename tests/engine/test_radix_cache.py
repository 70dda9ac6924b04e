"""Property tests: RadixCache against a naive reference, the common-prefix helper every token
trie walks with, and the slot allocator."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory import TokenToKVPoolAllocator
from engine.radix_cache import RadixCache
from engine.token_trie import common_prefix_len
from tests.helpers import tree_paths

POOL = 400
DEV = torch.device("cpu")

keys = st.lists(st.integers(0, 3), min_size=1, max_size=12)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), keys),
    st.tuples(st.just("match"), keys),
    st.tuples(st.just("lock"), keys),
    st.tuples(st.just("unlock"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 20)),
), max_size=60)


def longest_cached_prefix(stored: dict[tuple, int], key: list[int]) -> int:
    """Reference: the tree holds a set of token paths; a prefix is cached if some path has it."""
    best = 0
    for path in stored:
        n = 0
        while n < min(len(path), len(key)) and path[n] == key[n]:
            n += 1
        best = max(best, n)
    return best


@settings(max_examples=150, deadline=None)
@given(ops)
def test_radix_cache_matches_reference(script):
    alloc = TokenToKVPoolAllocator(POOL, DEV)
    cache = RadixCache(alloc)
    stored: dict[tuple, int] = {}  # path -> 1 (paths inserted and not fully evicted)
    slot_of: dict[tuple, int] = {}  # token prefix -> slot that holds its last token
    locks = []
    for op, arg in script:
        if op == "insert":
            slots = alloc.alloc(len(arg))
            if slots is None:
                continue
            have = cache.insert(arg, slots)
            assert have == longest_cached_prefix(stored, arg)
            alloc.free(slots[:have])  # the tree kept its own slots for the shared part
            for i in range(have, len(arg)):
                slot_of[tuple(arg[:i + 1])] = int(slots[i])
            stored[tuple(arg)] = 1
        elif op in ("match", "lock"):
            idx, node = cache.match_prefix(arg)
            n = longest_cached_prefix(stored, arg)
            assert len(idx) == n
            assert idx.tolist() == [slot_of[tuple(arg[:i + 1])] for i in range(n)]
            if op == "lock" and n:
                cache.inc_lock_ref(node)
                locks.append((node, n))
        elif op == "unlock" and locks:
            node, _ = locks.pop(arg % len(locks))
            cache.dec_lock_ref(node)
        elif op == "evict":
            cache.evict(arg)
            # Rebuild the reference from what the tree still holds.
            stored = dict.fromkeys(tree_paths(cache), 1)
            # Locked prefixes are never evicted.
            for node, _ in locks:
                assert node.lock_ref > 0
        # Accounting: every slot is free or in the tree, split into evictable and protected.
        assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == POOL
        assert cache.evictable_size() + cache.protected_size() == cache.total_tokens()
    for node, _ in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.evict(POOL)
    assert alloc.available_size() == POOL
    alloc.check_no_duplicates()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=10), st.lists(st.integers(0, 2), max_size=14), st.data())
def test_common_prefix_len_matches_reference(key, tokens, data):
    start = data.draw(st.integers(0, len(tokens)))
    end = data.draw(st.integers(start, len(tokens)))
    expect = longest_cached_prefix({tuple(key): 1}, tokens[start:end])
    assert common_prefix_len(key, tokens, start, end) == expect
    assert common_prefix_len(tuple(key), tokens, start, end) == expect  # no fast path: same answer
    if start == 0 and end == len(tokens):
        assert common_prefix_len(key, tokens) == expect


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-30, 30), max_size=80))
def test_allocator_never_double_allocates(script):
    alloc = TokenToKVPoolAllocator(64, DEV)
    held: list[torch.Tensor] = []
    for n in script:
        if n > 0:
            got = alloc.alloc(n)
            if got is None:
                assert n > alloc.available_size()
            else:
                held.append(got)
        elif held:
            alloc.free(held.pop(abs(n) % len(held)))
        live = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert len(torch.unique(live)) == len(live)
        assert 0 not in live.tolist()  # slot 0 is reserved for padding
        assert alloc.available_size() + len(live) == 64
    for h in held:
        alloc.free(h)
    alloc.check_no_duplicates()
    assert alloc.available_size() == 64


def test_match_splits_node_at_exact_boundary():
    alloc = TokenToKVPoolAllocator(32, DEV)
    cache = RadixCache(alloc)
    slots = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], slots)
    idx, node = cache.match_prefix([1, 2, 3, 9])
    assert idx.tolist() == slots[:3].tolist()
    assert node.key == [1, 2, 3] and list(node.children) == [4]
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    assert cache.evict(100) == 3  # only the unlocked tail [4, 5, 6] goes
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 3
    assert alloc.available_size() == 32
