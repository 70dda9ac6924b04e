"""Radix prefix cache over token ids whose nodes own KV slots, and its no-cache twin. Both
implement engine.cache_manager.PrefixCache; the CacheManager does everything request-related.

Accounting: every slot the tree holds is either evictable (its node has lock_ref 0) or
protected (some running request locked the node or a descendant). With no request running,
`allocator.available + evictable + protected == total` must hold (CacheManager.check_idle).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from engine.hicache.eviction import EvictionPolicy, LRUPolicy
from engine.memory import TokenToKVPoolAllocator
from engine.token_trie import descend


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "hit_count", "priority",
                 "depth", "host_value", "host_ref")

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: TreeNode | None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # int64 device KV slots, one per token of key (None: not on the device)
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0  # admissions that used it (RadixCache.record_hit)
        self.priority = 0  # the most important (lowest, as vLLM's) priority of its users
        self.depth = 0  # tokens on the path above it
        self.host_value: torch.Tensor | None = None  # host-tier slots (engine.hicache only)
        self.host_ref = 0  # a host-tier load or write in progress reads it (engine.hicache only)

    def __lt__(self, other: TreeNode) -> bool:  # eviction's tie-break between equal keys: recency
        return self.last_access < other.last_access


class RadixCache:
    """The engine's prefix cache (SGLang's RadixCache). Its nodes own KV slots (freed to the
    allocator on eviction) and lock refs (a running request's prefix cannot be evicted); a match
    splits the node it ends inside of, so a request can lock exactly its prefix. Recency is a
    tick per operation, and eviction builds a heap of unlocked leaves only when the pool runs
    short, so the scheduler's match and insert cost the walk (engine.token_trie.descend, shared
    with the cluster's tries) and a stamp per node, nothing more."""

    shares_prefixes = True

    def __init__(self, allocator: TokenToKVPoolAllocator, policy: EvictionPolicy | None = None) -> None:
        self.allocator = allocator  # evicted slots go back here
        self.policy = policy if policy is not None else LRUPolicy()  # eviction order (engine.hicache.eviction)
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        # (kind, token path, start) of every insert and eviction: the node added or dropped holds
        # path[start:]; path[:start] is its parent's path. Set by CacheManager.subscribe.
        self.on_event: Callable[[str, list[int], int], None] | None = None
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], self._empty, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    # ---- queries -------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `key`: its KV slots and the node where it ends.

        A node is split when the match ends inside it, so the returned node's path is exactly
        the match. Callers pass at most len(fill_ids) - 1 tokens so one is always computed."""
        now = self._tick()
        path, _ = descend(self.root, key, len(key), self._split)
        for node in path:
            node.last_access = now
        if not path:
            return self._empty, self.root
        return torch.cat([node.value for node in path]), path[-1]

    def _split(self, parent: TreeNode, child: TreeNode, n: int) -> TreeNode:
        # Both parts were just reached by the operation under way (the clock is its tick).
        value, host_value = child.value, child.host_value
        head = TreeNode(child.key[:n], None if value is None else value[:n], parent)
        head.lock_ref, head.last_access = child.lock_ref, self._clock
        head.hit_count, head.priority, head.depth = child.hit_count, child.priority, child.depth
        head.children[child.key[n]] = child
        parent.children[child.key[0]] = head
        child.parent, child.key, child.last_access = head, child.key[n:], self._clock
        child.depth += n
        if value is not None:
            child.value = value[n:]
        if host_value is not None:
            head.host_value, child.host_value = host_value[:n], host_value[n:]
        return head

    # ---- updates -------------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor, priority: int | None = None) -> int:
        """Insert key -> value; returns how many leading tokens the tree already had. `priority`:
        the inserting request's (lower = more important; kept per node for the priority policy)."""
        now = self._tick()
        path, matched = descend(self.root, key, len(key), self._split)
        for node in path:
            node.last_access = now
        if priority is not None:
            for node in path:
                node.priority = min(node.priority, priority)
        if matched < len(key):
            parent = path[-1] if path else self.root
            leaf = TreeNode(key[matched:], value[matched:].clone(), parent)
            leaf.last_access, leaf.depth = now, matched
            if priority is not None:
                leaf.priority = priority
            parent.children[key[matched]] = leaf
            self._evictable += len(leaf.key)
            if self.on_event is not None:
                self.on_event("stored", list(key), matched)
        return matched

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache lock_ref would go negative")
            node.lock_ref -= 1
            node = node.parent

    def record_hit(self, node: TreeNode, priority: int | None = None) -> None:
        """An admitted request uses the path to `node`: count the hit (lfu, slru, cost_aware) and
        keep the most important priority (lower value) of its users (priority)."""
        while node is not self.root:
            node.hit_count += 1
            if priority is not None and priority < node.priority:
                node.priority = priority
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, in the policy's order (LRU by
        default)."""
        key, now = self.policy.key, self._clock
        heap = [(key(n, now), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_tokens:
            _, leaf = heapq.heappop(heap)
            if self.on_event is not None:
                path = self._path(leaf)
                self.on_event("removed", path, len(path) - len(leaf.key))
            self.allocator.free(leaf.value)
            evicted += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (key(parent, now), parent))
        return evicted

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node

    def _path(self, node: TreeNode) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def total_tokens(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def leaf_paths(self) -> list[list[int]]:
        """The token path of every leaf: together, everything the tree holds."""
        return [self._path(n) for n in self._nodes() if not n.children]


class NoRadixCache:
    """`disable_radix_cache=True`: keeps and shares nothing; every slot is freed at a request's end."""

    shares_prefixes = False

    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self.on_event: Callable[[str, list[int], int], None] | None = None  # never called: nothing is stored

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, None]:
        return self._empty, None

    def insert(self, key: list[int], value: torch.Tensor, priority: int | None = None) -> int:
        return len(key)  # keeps none of it: the caller frees it all

    def record_hit(self, node: None, priority: int | None = None) -> None:
        pass

    def inc_lock_ref(self, node: None) -> None:
        pass

    def dec_lock_ref(self, node: None) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_tokens(self) -> int:
        return 0

    def leaf_paths(self) -> list[list[int]]:
        return []
