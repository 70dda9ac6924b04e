"""Routing policies: which engine gets a (tokenized) request.

`kv_events` routes on what each engine's cache holds and what its queued requests will store,
exactly (cluster/kv_index.py, fed by the engines' KV events, the same for every front end): each
engine costs prefill_weight x the prompt tokens it would compute plus load_weight x the tokens
in flight on it (Dynamo's KV router cost) plus evict_weight x the tokens new to its pool x how
much fuller its KV is than the emptiest candidate's (what they would push out of a full engine
that an emptier one keeps), and the cheapest wins. With the hierarchical cache, prompt tokens in
an engine's host tier cost host_hit_weight each and those in the shared storage tier (any engine
can load them) storage_hit_weight: between a pool hit (0) and a recompute (prefill_weight).
`cache_aware` keeps, per engine, an approximate radix tree of the prompts it was sent (token
level), trimmed LRU to the engine's KV capacity and corrected by the engines' eviction events;
a request goes to the engine with the longest match unless the load is imbalanced beyond a
threshold or the match is short, then to the engine where it costs the least load and eviction.
`round_robin` and `least_load` ignore the cache.

Ties (no load to tell the engines apart, as at low concurrency) go to the engine holding the
least KV, not to the first one: new prefixes spread over the engines instead of evicting each
other on one.

A request under a LoRA adapter goes only to engines that serve the adapter, and every policy
sees its prompt as the adapter's path (`adapter_path`: the tokens behind the adapter's root
token), so prefix matches count that adapter's KV only. Adapter affinity: `kv_events` adds
lora_load_cost prompt tokens' worth of prefill to the cost of an engine that does not hold the
adapter in host memory (a read from its folder, and another adapter pushed out); `cache_aware`
keeps to the engines holding it unless they are overloaded by its balance thresholds. Without
one, the least loaded engine gets it. `round_robin` and `least_load` ignore adapters as they
ignore the cache. The router knows an engine's adapters from its reports (`set_adapters`) and,
between them, from what it routed there (`EngineAdapters`)."""

from __future__ import annotations

import copy
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol, get_args

import msgspec

from actors.protocol import adapter_path, adapter_root
from cluster.kv_index import KVIndex, KVIndexStats
from engine.errors import ConfigError
from engine.token_trie import descend

RoutingName = Literal["round_robin", "least_load", "cache_aware", "kv_events"]
POLICIES = get_args(RoutingName)


class _Node:
    __slots__ = ("children", "parent", "key")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key


class PrefixTree:
    """Token-level radix tree without values: what one engine (probably) has cached.

    Recency is one ordered dict of nodes, least recent first. A lookup or insert moves the nodes
    of its path to the end, deepest first, so every node stays after all of its descendants and
    the first node is always a leaf: trimming pops from the front. Each operation costs the
    length of its path plus what it trims, whatever the size of the tree.

    Not the engine's RadixCache: a guess holds no KV slots or locks, trims itself to a capacity
    on every insert (the engine evicts only when its pool runs short, from a heap built then),
    and must drop what an engine's eviction event names, so its nodes keep their parent and
    their place in the order. It shares the walk (engine.token_trie.descend); a lookup does not
    split, an insert does."""

    def __init__(self, capacity: int) -> None:
        self.root = _Node([], None)
        self.capacity = capacity
        self.size = 0
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):
            self._lru[node] = None
            self._lru.move_to_end(node)

    def match(self, tokens: list[int]) -> int:
        path, matched = descend(self.root, tokens, len(tokens))
        self._touch(path)
        return matched

    def insert(self, tokens: list[int]) -> None:
        path, i = descend(self.root, tokens, len(tokens), self._split)
        if i < len(tokens):
            parent = path[-1] if path else self.root
            leaf = _Node(tokens[i:], parent)
            parent.children[tokens[i]] = leaf
            self.size += len(leaf.key)
            path.append(leaf)
        self._touch(path)
        if self.size > self.capacity:
            self.trim(self.size - self.capacity)

    @staticmethod
    def _split(parent: _Node, child: _Node, n: int) -> _Node:
        # The head joins the recency order when its path is touched, after its tail.
        head = _Node(child.key[:n], parent)
        parent.children[child.key[0]] = head
        child.key, child.parent = child.key[n:], head
        head.children[child.key[0]] = child
        return head

    def _drop(self, node: _Node) -> None:
        del node.parent.children[node.key[0]]
        self._lru.pop(node, None)
        self.size -= len(node.key)

    def remove(self, path: list[int], start: int) -> None:
        """The engine evicted path[start:] (a leaf of its tree, so it holds nothing that starts
        with path[:start + 1]) and keeps path[:start]: drop the former, keep the latter."""
        if start >= len(path):
            return
        nodes, matched = descend(self.root, path, start + 1)
        if matched <= start:  # not held, or we hold another path there
            return
        node = nodes[-1]  # it holds path[start]
        keep = start - sum(len(n.key) for n in nodes[:-1])  # of its tokens, those before the evicted part
        self._drop_below(node)
        if keep:  # the node keeps its place in the order: it is a leaf now
            self.size -= len(node.key) - keep
            node.key = node.key[:keep]
        else:
            self._drop(node)

    def _drop_below(self, node: _Node) -> None:
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            self._lru.pop(n, None)
            self.size -= len(n.key)
            stack.extend(n.children.values())
        node.children = {}

    def trim(self, num_tokens: int) -> None:
        """Drop least recently used leaves until num_tokens are gone (or the tree is empty)."""
        freed = 0
        while freed < num_tokens and self._lru:
            leaf = next(iter(self._lru))
            freed += len(leaf.key)
            self._drop(leaf)


@dataclass
class EngineLoad:
    healthy: bool = True
    accepting: bool = True  # False: draining or gone for good (takes no new request)
    requests: int = 0  # in flight through this router
    tokens: int = 0  # prompt + max output tokens of those requests


@dataclass
class EngineAdapters:
    """The router's view of one engine's LoRA adapters: the names it serves (None: not reported
    yet, so it takes no adapter request) and the root tokens (`adapter_root`) of those in its host
    memory, least recently used first, at most `capacity`; from its reports, and between them
    from what was routed there (the engine reads a routed adapter into host memory, evicting its
    least recently used idle one)."""

    names: frozenset[str] | None = None
    resident: OrderedDict[int, None] = field(default_factory=OrderedDict)
    capacity: int = 0

    def touch(self, root: int) -> None:
        self.resident[root] = None
        self.resident.move_to_end(root)
        while len(self.resident) > max(self.capacity, 1):
            self.resident.popitem(last=False)


def adapter_of(key: list[int]) -> int | None:
    """The root token of the adapter a routing key (`adapter_path`) runs under; None: the base model."""
    return key[0] if key and key[0] < 0 else None


class RoutingPolicy(Protocol):
    """Chooses an engine among the healthy candidates for a tokenized request. It may read the
    router's loads and prefix trees; the router accounts the choice (loads, trees, stats).
    `input_ids` is the routing key: a LoRA request's prompt behind its adapter's root token."""

    def choose(self, router: Router, input_ids: list[int], candidates: list[int]) -> int: ...


@dataclass
class RoundRobin:
    _turn: itertools.count = field(default_factory=itertools.count)

    def choose(self, router: Router, input_ids: list[int], candidates: list[int]) -> int:
        return candidates[next(self._turn) % len(candidates)]


@dataclass
class LeastLoad:
    def choose(self, router: Router, input_ids: list[int], candidates: list[int]) -> int:
        return router.least_loaded(candidates)


@dataclass
class CacheAware:
    """The longest cached prefix wins, unless the load is imbalanced past both thresholds or the
    match is too short to matter: then the least loaded engine."""

    balance_abs_threshold: int = 8  # requests
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3  # share of the prompt that must match to follow the cache
    evict_weight: float = 1.0  # per new token, x the engine's KV use above the emptiest candidate's

    def choose(self, router: Router, input_ids: list[int], candidates: list[int]) -> int:
        candidates = router.affine(input_ids, candidates, self.balance_abs_threshold, self.balance_rel_threshold)
        reqs = [router.loads[i].requests for i in candidates]
        if (max(reqs) - min(reqs) > self.balance_abs_threshold
                and max(reqs) > self.balance_rel_threshold * max(min(reqs), 1)):
            return router.least_loaded(candidates)
        matches = {i: router.trees[i].match(input_ids) for i in candidates}
        best = max(candidates, key=lambda i: (matches[i], -router.loads[i].requests, -router.cached_tokens(i), -i))
        if matches[best] >= self.cache_threshold * len(input_ids):
            return best
        # A short match (a BOS token, a common template head) is no reason to pile up on one
        # engine: the least load, plus what the new tokens would push out of a fuller KV.
        pressure = router.kv_pressure(candidates)

        def cost(i: int) -> tuple[float, int, int, int]:
            evict = self.evict_weight * (len(input_ids) - matches[i]) * pressure[i]
            return router.loads[i].tokens + evict, router.loads[i].requests, router.cached_tokens(i), i

        return min(candidates, key=cost)


@dataclass
class KVEvents:
    """Exact prefix routing: the cheapest engine, by prefill_weight x uncached prompt tokens
    (from the engines' own KV events) + load_weight x tokens in flight there: the larger of
    this router's (prompt + max output of the requests it sent there) and the prompt tokens of
    every front end's requests the engine reports queued or running (a lower bound of its load
    that this router's own count misses) + evict_weight x uncached tokens x the engine's KV use
    above the emptiest candidate's (Router.kv_pressure: zero when every engine is as full, so it
    spreads new prefixes without changing the balance of cache and load among full engines).
    Prompt tokens past the pool's match cost host_hit_weight each where the engine's host tier
    holds them and storage_hit_weight where the shared storage tier does (a copy instead of a
    forward; the pool slots they take still count for eviction), prefill_weight beyond.
    Equal costs go to the engine holding the least KV."""

    prefill_weight: float = 1.0
    load_weight: float = 0.1
    evict_weight: float = 1.0
    host_hit_weight: float = 0.1  # per prompt token loaded from the engine's host tier
    storage_hit_weight: float = 0.3  # per prompt token loaded from the shared storage tier
    # A LoRA request on an engine without its adapter in host memory: the adapter's read (and the
    # idle adapter it pushes out) costs this many prompt tokens' worth of prefill.
    lora_load_cost: float = 256.0

    def __post_init__(self) -> None:
        if not 0 <= self.host_hit_weight <= self.storage_hit_weight <= self.prefill_weight:
            raise ConfigError("need 0 <= host_hit_weight <= storage_hit_weight <= prefill_weight")
        if not self.lora_load_cost >= 0:
            raise ConfigError(f"lora_load_cost must be >= 0, got {self.lora_load_cost!r}")

    def choose(self, router: Router, input_ids: list[int], candidates: list[int]) -> int:
        index = router.kv_index
        pressure = router.kv_pressure(candidates)
        n = len(input_ids)
        root = adapter_of(input_ids)

        def cost(i: int) -> tuple[float, int, int, int]:
            device, host, storage = index.match_tiers(i, input_ids)
            load = router.loads[i]
            tokens = max(load.tokens, index.queued_tokens(i))
            c = (self.prefill_weight * (n - storage) + self.host_hit_weight * (host - device)
                 + self.storage_hit_weight * (storage - host) + self.evict_weight * pressure[i] * (n - device)
                 + self.load_weight * tokens)
            if root is not None and root not in router.adapters[i].resident:
                c += self.prefill_weight * self.lora_load_cost
            return c, router.cached_tokens(i), load.requests, i

        return min(candidates, key=cost)


# The policies by the name ClusterConfig.routing takes (their fields: ClusterConfig.routing_options);
# a new policy is a class and a line here.
ROUTING_POLICIES: Mapping[str, Callable[..., RoutingPolicy]] = MappingProxyType(
    {"round_robin": RoundRobin, "least_load": LeastLoad, "cache_aware": CacheAware, "kv_events": KVEvents})


class RoutingStats(msgspec.Struct, kw_only=True):
    policy: str
    decisions: list[int]  # requests sent to each engine
    # Why: "cache_match" (the chosen engine held part of the prompt), "load" (no engine held
    # any: chosen on load alone), "fallback" (a re-route after an engine died or drained).
    reasons: dict[str, int] = {}
    # Prompt tokens the chosen engine held, by the router's view (the exact index for kv_events,
    # the approximate trees otherwise) / prompt tokens routed.
    prefix_hit_rate: float
    kv_index: KVIndexStats
    # LoRA requests sent to an engine holding their adapter in host memory (by the router's view),
    # and to one that had to read it.
    lora_warm: int = 0
    lora_cold: int = 0


@dataclass
class Router:
    """Engine loads and approximate prefix trees, shared by every policy."""

    policy: str | RoutingPolicy
    num_engines: int
    kv_capacity: int = 1 << 16
    policy_options: Mapping[str, float] = field(default_factory=dict)
    loads: list[EngineLoad] = field(default_factory=list)
    decisions: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    matched_tokens: int = 0
    prompt_tokens: int = 0
    lora_warm: int = 0
    lora_cold: int = 0
    # Called (under the caller's lock) with an engine's index when it answers again after it did
    # not: the owner refreshes what it knows of the engine (its LoRA adapters).
    on_recover: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        self.capacity = [self.kv_capacity] * self.num_engines  # each engine's KV pool, in tokens
        self.policy_name = self.policy if isinstance(self.policy, str) else type(self.policy).__name__
        if isinstance(self.policy, str):
            if self.policy not in ROUTING_POLICIES:
                raise ValueError(f"routing must be one of {POLICIES}, got {self.policy!r}")
            self.policy = ROUTING_POLICIES[self.policy](**self.policy_options)
        self.exact = isinstance(self.policy, KVEvents)
        self.loads = [EngineLoad() for _ in range(self.num_engines)]
        self.roles = ["null"] * self.num_engines
        self._prefill_policy: RoutingPolicy | None = None
        self.trees = [PrefixTree(self.kv_capacity) for _ in range(self.num_engines)]
        self.kv_index = KVIndex(self.num_engines)
        self.adapters = [EngineAdapters() for _ in range(self.num_engines)]

    def healthy(self) -> list[int]:
        return [i for i, ld in enumerate(self.loads) if ld.healthy and ld.accepting]

    @property
    def disaggregated(self) -> bool:
        """Prefill/decode disaggregation: a request goes to a decode engine and a prefill engine."""
        return "prefill" in self.roles

    def _policy(self, pool: str | None) -> RoutingPolicy:
        """The policy for a pool: the prefill pool has its own instance, so a stateful policy
        (round robin's turn) takes turns within each pool, not across the two picks of a request."""
        if pool != "prefill":
            return self.policy
        if self._prefill_policy is None:
            self._prefill_policy = copy.deepcopy(self.policy)
        return self._prefill_policy

    def add_engine(self, kv_capacity: int, role: str = "null") -> int:
        """A new engine joined (indices are never reused); returns its index. role: its
        disaggregation_mode ("prefill" engines are picked only with pool="prefill")."""
        self.roles.append(role)
        self.loads.append(EngineLoad())
        self.capacity.append(kv_capacity)
        self.trees.append(PrefixTree(kv_capacity))
        self.kv_index.add_engine()
        self.adapters.append(EngineAdapters())
        self.num_engines += 1
        return self.num_engines - 1

    def stop_accepting(self, engine: int) -> None:
        """The engine drains or has left: no new request goes there."""
        self.loads[engine].accepting = False

    def least_loaded(self, candidates: list[int]) -> int:
        """The least loaded engine; of equally loaded ones, the one holding the least KV."""
        return min(candidates, key=lambda i: (self.loads[i].tokens, self.loads[i].requests, self.cached_tokens(i), i))

    def cached_tokens(self, engine: int) -> int:
        """What the engine's prefix cache holds, by this router's view (the exact index with
        kv_events, the approximate tree otherwise)."""
        return self.kv_index.cached_tokens(engine) if self.exact else self.trees[engine].size

    def kv_pressure(self, candidates: list[int]) -> dict[int, float]:
        """Per candidate: the share of its KV pool in use, minus the emptiest candidate's. New
        tokens on a fuller engine push more cached prefixes out, sooner. In use: the cache and
        the prompts in flight there (the approximate tree has them from the moment they are
        routed; the exact index, once stored, so their own count is added: a running prompt
        may count twice, an overestimate on a busy engine)."""
        use = {}
        for i in candidates:
            held = self.cached_tokens(i)
            if self.exact:
                held += max(self.kv_index.in_flight[i].tokens, self.kv_index.queued_tokens(i))
            use[i] = min(1.0, held / max(self.capacity[i], 1))
        low = min(use.values())
        return {i: u - low for i, u in use.items()}

    def pick(self, input_ids: list[int], cost: int, exclude: frozenset[int] = frozenset(),
             pool: str | None = None, lora_name: str | None = None) -> int | None:
        """Choose an engine (None if none is healthy) and account the request on it. pool: the
        engines of that role only; None: any that takes requests itself (not a prefill engine).
        lora_name: the request's LoRA adapter (only engines serving it are candidates)."""
        candidates = [i for i in self.healthy() if i not in exclude
                      and (self.roles[i] == pool if pool else self.roles[i] != "prefill")
                      and (lora_name is None or self.serves(i, lora_name))]
        if not candidates:
            return None
        key = adapter_path(input_ids, lora_name)
        choice = self._policy(pool).choose(self, key, candidates)
        if self.exact:  # held in any tier: loaded, not computed
            matched = self.kv_index.match_tiers(choice, key)[2]
            self.kv_index.in_flight[choice].add(key)
        else:
            matched = self.trees[choice].match(key)
            self.trees[choice].insert(key)
        if lora_name is not None:
            matched = max(matched - 1, 0)  # the adapter's root is no prompt token
            root = key[0]
            view = self.adapters[choice]
            if root in view.resident:
                self.lora_warm += 1
            else:
                self.lora_cold += 1
            view.touch(root)
        self.matched_tokens += matched
        self.reasons["fallback" if exclude else "cache_match" if matched else "load"] += 1
        self.prompt_tokens += len(input_ids)
        self.decisions[choice] += 1
        self.loads[choice].requests += 1
        self.loads[choice].tokens += cost
        return choice

    def done(self, engine: int, cost: int, input_ids: list[int] | None = None, lora_name: str | None = None) -> None:
        """The request picked for `engine` ended (input_ids: its prompt, for exact routing;
        lora_name: its adapter, as given to pick)."""
        self.loads[engine].requests -= 1
        self.loads[engine].tokens -= cost
        if self.exact and input_ids is not None:
            self.kv_index.in_flight[engine].discard(adapter_path(input_ids, lora_name))

    # ---- LoRA adapters ---------------------------------------------------------------------
    def set_adapters(self, engine: int, names: list[str], resident: list[str], capacity: int) -> None:
        """Engine `engine` reported its adapters: those it serves, and those in host memory
        (least recently used first) of the `capacity` it holds."""
        view = self.adapters[engine]
        view.names = frozenset(names)
        view.capacity = capacity
        view.resident = OrderedDict((adapter_root(n), None) for n in resident)

    def serves(self, engine: int, lora_name: str) -> bool:
        """Whether the engine serves adapter `lora_name`, by its last report."""
        names = self.adapters[engine].names
        return names is not None and lora_name in names

    def adapter_names(self) -> list[str]:
        """The adapters served by any engine that takes requests, sorted."""
        names: set[str] = set()
        for view, load in zip(self.adapters, self.loads):
            if load.accepting and view.names:
                names |= view.names
        return sorted(names)

    def affine(self, key: list[int], candidates: list[int], abs_threshold: float, rel_threshold: float) -> list[int]:
        """Adapter affinity for a routing key: the candidates holding its adapter in host memory,
        unless even the least loaded of them has more requests than the least loaded candidate by
        both thresholds (CacheAware's balance rule); all of them for the base model, or when none
        holds it."""
        root = adapter_of(key)
        if root is None:
            return candidates
        warm = [i for i in candidates if root in self.adapters[i].resident]
        if not warm:
            return candidates
        low = min(self.loads[i].requests for i in candidates)
        busy = min(self.loads[i].requests for i in warm)
        if busy - low > abs_threshold and busy > rel_threshold * max(low, 1):
            return candidates
        return warm

    def evicted(self, engine: int, paths: list[list[int]]) -> None:
        """The engine evicted, for each path, the node that began at its last token."""
        for p in paths:
            if p:
                self.trees[engine].remove(p, len(p) - 1)

    def set_healthy(self, engine: int, healthy: bool) -> None:
        was = self.loads[engine].healthy
        if not healthy and was:
            self.forget(engine)  # a restarted engine starts cold
            # ...and may have lost the adapters loaded at run time: none routed there until it
            # reports them again (the owner's on_recover asks it).
            self.adapters[engine] = EngineAdapters()
        self.loads[engine].healthy = healthy
        if healthy and not was and self.on_recover is not None:
            self.on_recover(engine)

    def forget(self, engine: int) -> None:
        """Empty the approximate tree of the engine (it restarted, or its eviction events were
        lost): it matches nothing until requests are routed there again."""
        self.trees[engine] = PrefixTree(self.capacity[engine])

    def stats(self) -> RoutingStats:
        return RoutingStats(
            policy=self.policy_name,
            decisions=[self.decisions[i] for i in range(self.num_engines)],
            reasons=dict(self.reasons),
            prefix_hit_rate=self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            kv_index=self.kv_index.stats(),
            lora_warm=self.lora_warm,
            lora_cold=self.lora_cold,
        )
