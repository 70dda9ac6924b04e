"""Router policies and the approximate prefix tree, without Ray."""

from __future__ import annotations

import random

import pytest

from cluster.routing import POLICIES, ROUTING_POLICIES, CacheAware, PrefixTree, Router


def tree_tokens(tree: PrefixTree) -> int:
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        total += len(node.key)
        stack.extend(node.children.values())
    return total


def check_invariants(tree: PrefixTree) -> None:
    """size is exact; the recency order holds every node once, each after all its descendants."""
    assert tree.size == tree_tokens(tree)
    order = {node: i for i, node in enumerate(tree._lru)}
    stack = list(tree.root.children.values())
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        assert node in order
        for child in node.children.values():
            assert order[child] < order[node]
        stack.extend(node.children.values())
    assert seen == len(order)


def test_match_insert_and_split():
    t = PrefixTree(capacity=1000)
    t.insert([1, 2, 3, 4, 5])
    assert t.match([1, 2, 3, 4, 5, 6]) == 5
    t.insert([1, 2, 9])  # splits [1..5] at 2
    assert t.match([1, 2, 9, 9]) == 3 and t.match([1, 2, 3]) == 3 and t.match([7]) == 0
    assert t.size == 6
    check_invariants(t)


def test_trim_drops_least_recently_used_leaves_first():
    t = PrefixTree(capacity=1000)
    t.insert([1, 1, 1])
    t.insert([2, 2, 2])
    t.insert([3, 3, 3])
    t.match([1, 1, 1])  # now [2,2,2] is the oldest
    t.trim(3)
    assert t.match([2, 2, 2]) == 0 and t.match([1, 1, 1]) == 3 and t.match([3, 3, 3]) == 3
    check_invariants(t)


def test_capacity_is_kept_and_shared_prefixes_survive():
    t = PrefixTree(capacity=20)
    head = [7] * 8
    for i in range(10):
        t.insert(head + [i, i, i, i])
        t.match(head)
        assert t.size <= 20
        check_invariants(t)
    assert t.match(head) == 8  # the shared head is an ancestor: trimmed only after its leaves


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    t = PrefixTree(capacity=200)
    paths = []
    for _ in range(500):
        op = rng.random()
        if op < 0.6 or not paths:
            p = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
            paths.append(p)
            t.insert(p)
        elif op < 0.85:
            t.match(rng.choice(paths))
        else:
            p = rng.choice(paths)
            t.remove(p, rng.randrange(len(p)))
        assert t.size <= 200
        check_invariants(t)


def test_remove_drops_what_the_engine_evicted_and_keeps_its_parent():
    t = PrefixTree(capacity=100)
    t.insert([1, 2, 3, 4])
    t.insert([1, 2, 5, 6])
    t.remove([1, 2, 3, 4], 2)  # the engine evicted [3, 4] below [1, 2]
    assert t.match([1, 2, 3, 4]) == 2 and t.match([1, 2, 5, 6]) == 4
    t.remove([1, 2, 5, 6, 7, 8], 4)  # its output tokens, which the tree never had: nothing to drop
    assert t.match([1, 2, 5, 6]) == 4
    t.remove([1, 2, 5, 6, 7, 8], 3)  # a node that began inside ours: we keep the part before it
    assert t.match([1, 2, 5, 6]) == 3 and t.size == 3
    t.remove([9, 9], 0)  # never held
    t.remove([1, 2, 5], 0)  # everything from the root
    assert t.size == 0 and t.match([1]) == 0
    check_invariants(t)


def test_evictions_of_longer_engine_paths_reach_the_tree():
    """The engine caches prompt + output: its evicted path is longer than the prompt we routed."""
    r = Router("cache_aware", 0)
    engine = r.add_engine(2200)
    prompt = list(range(1, 151))
    r.pick(prompt, 160)
    r.evicted(engine, [prompt + [7]])  # the output's node: the prompt stays
    assert r.trees[engine].match(prompt) == 150
    r.evicted(engine, [prompt[:1]])  # the node holding the prompt and its output
    assert r.trees[engine].match(prompt) == 0


def test_round_robin_and_least_load():
    rr = Router("round_robin", 3)
    assert [rr.pick([1], 1) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router("least_load", 2)
    assert ll.pick([1], 100) == 0 and ll.pick([1], 10) == 1 and ll.pick([1], 10) == 1
    ll.done(0, 100)
    assert ll.pick([1], 5) == 0


def test_cache_aware_follows_the_prefix_until_imbalanced():
    r = Router(CacheAware(balance_abs_threshold=2, balance_rel_threshold=1.5), 2)
    prompt = list(range(100))
    first = r.pick(prompt, 10)
    assert r.pick(prompt + [1], 10) == first  # same prefix, same engine
    assert r.pick(prompt + [2], 10) == first
    # 3 vs 0 requests in flight: past both thresholds, the least loaded engine wins.
    assert r.pick(prompt + [3], 10) == 1 - first
    assert r.stats().prefix_hit_rate == pytest.approx(200 / 403)  # two of four requests hit 100 tokens


def test_unhealthy_and_excluded_engines_are_skipped():
    r = Router("cache_aware", 2)
    r.set_healthy(0, False)
    assert r.pick([1, 2], 3) == 1
    assert r.pick([1, 2], 3, exclude=frozenset({1})) is None
    r.set_healthy(0, True)
    assert r.pick([5, 6], 3, exclude=frozenset({1})) == 0


def test_a_restarted_engine_starts_cold():
    r = Router("cache_aware", 2)
    prompt = list(range(50))
    engine = r.pick(prompt, 1)
    assert r.trees[engine].match(prompt) == 50
    r.set_healthy(engine, False)
    r.set_healthy(engine, True)
    assert r.trees[engine].match(prompt) == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        Router("random", 2)


def test_every_configurable_policy_is_registered():
    assert set(POLICIES) == set(ROUTING_POLICIES)
    for name in POLICIES:
        assert Router(name, 2).pick([1, 2, 3], 1) in (0, 1)


def test_a_policy_is_a_class_with_choose():
    class Last:
        def choose(self, router, input_ids, candidates):
            return candidates[-1]

    r = Router(Last(), 3)
    assert r.pick([1], 1) == 2 and r.stats().policy == "Last"


def _one_at_a_time(r: Router, prompts: list[list[int]], out: int = 16) -> list[int]:
    """Route each prompt after the previous one ended (no load tells the engines apart)."""
    chosen = []
    for p in prompts:
        i = r.pick(p, len(p) + out)
        r.done(i, len(p) + out, p)
        chosen.append(i)
    return chosen


@pytest.mark.parametrize("policy", ["cache_aware", "least_load"])
def test_ties_spread_new_prefixes_over_the_engines(policy):
    """At low concurrency every engine is idle at each decision: new tenants must not all land
    on the first engine (it would evict them in turn while the other holds nothing)."""
    r = Router(policy, 0)
    for _ in range(2):
        r.add_engine(2200)
    tenants = [[100 * t + k for k in range(1, 401)] for t in range(4)]
    assert sorted(_one_at_a_time(r, tenants)) == [0, 0, 1, 1]


def test_cache_aware_keeps_a_tenant_where_it_was_sent():
    r = Router("cache_aware", 0)
    for _ in range(2):
        r.add_engine(2200)
    tenants = [[100 * t + k for k in range(1, 401)] for t in range(4)]
    first = _one_at_a_time(r, tenants)
    again = _one_at_a_time(r, [p + [7] for p in tenants])
    assert again == first


def test_a_short_shared_head_does_not_pile_new_prefixes_onto_one_engine():
    """Tenants sharing a template head: cache_aware treats the short match as none and puts each
    new prefix where it pushes the least out of a fuller KV."""
    r = Router("cache_aware", 0)
    for _ in range(2):
        r.add_engine(2200)
    head = [1] * 16
    tenants = [head + [100 * t + k for k in range(384)] for t in range(1, 5)]
    assert sorted(_one_at_a_time(r, tenants)) == [0, 0, 1, 1]


def test_kv_pressure_is_relative_to_the_emptiest_engine():
    r = Router("cache_aware", 0)
    for cap in (1000, 1000, 2000):
        r.add_engine(cap)
    r.trees[0].insert(list(range(500)))
    r.trees[1].insert(list(range(1000, 1900)))
    r.trees[2].insert(list(range(3000, 4000)))
    assert r.kv_pressure([0, 1, 2]) == pytest.approx({0: 0.0, 1: 0.4, 2: 0.0})
    assert r.kv_pressure([1, 2]) == pytest.approx({1: 0.4, 2: 0.0})


def test_a_missed_heartbeat_keeps_the_engines_capacity():
    r = Router("cache_aware", 0)
    engine = r.add_engine(2200)
    r.set_healthy(engine, False)
    r.set_healthy(engine, True)
    assert r.trees[engine].capacity == 2200
    r.trees[engine].insert(list(range(3000)))
    assert r.trees[engine].size <= 2200
    r.forget(engine)
    assert r.trees[engine].capacity == 2200 and r.trees[engine].size == 0


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "cache_aware", "kv_events"])
def test_disaggregated_requests_pick_a_decode_engine_and_a_prefill_engine(policy):
    """A prefill engine is never a request's own engine; the prefill pool has its own policy
    state, so round robin turns over the decode engines too (a shared turn would alternate
    between the request's two picks and land every request on one decode engine)."""
    r = Router(policy, 0)
    for role in ("prefill", "decode", "prefill", "decode"):
        r.add_engine(1000, role)
    assert r.disaggregated
    picks = []
    for i in range(8):
        ids = [100 * i + k for k in range(4)]  # nothing shared: cache affinity does not decide
        decode, prefill = r.pick(ids, 10), r.pick(ids, 4, pool="prefill")
        picks.append((decode, prefill))
    assert {d for d, _ in picks} == {1, 3} and {p for _, p in picks} == {0, 2}, picks
    assert not Router("round_robin", 2).disaggregated
