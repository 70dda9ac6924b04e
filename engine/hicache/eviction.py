"""Eviction policies of the radix trees, by name (`radix_eviction_policy`).

A policy orders eviction candidates: the tree collects its unlocked leaves when the pool runs
short, keys each with `policy.key(node, now)` and evicts smallest key first (a parent that becomes
a leaf is keyed when it does). Keys are compared as given, then by the node's recency, so a policy
needs no tie-break of its own. A policy reads the node's bookkeeping, which the tree maintains for
every policy: `last_access` (the tree's tick of its last match or insert), `hit_count` (admissions
that used it: `RadixCache.record_hit`), `priority` (the most important priority of the requests
that inserted or used it; vLLM's convention: lower value = more important, default 0), `depth`
(tokens above it) and `len(node.key)` (tokens it holds). `now` is the tree's current tick."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from engine.radix_cache import TreeNode


class EvictionPolicy(ABC):
    """Orders eviction candidates: smallest `key` evicted first. Keys of one policy must be
    mutually comparable; they are taken when a node becomes a candidate, so a key may depend on
    `now` but is not refreshed while one eviction runs."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, node: TreeNode, now: int) -> Any: ...

    @classmethod
    def for_model(cls, hidden_size: int) -> EvictionPolicy:
        """The policy for a model of this hidden size (most policies do not depend on it)."""
        return cls()


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    EVICTION_POLICIES[cls.name] = cls
    return cls


def create_eviction_policy(name: str, hidden_size: int = 0) -> EvictionPolicy:
    """The policy registered under `name`, fitted to the model (`hidden_size`; 0: unknown, the
    policy's defaults); ValueError names the known ones."""
    cls = EVICTION_POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown radix_eviction_policy {name!r}; known: {sorted(EVICTION_POLICIES)}"
        )
    return cls.for_model(hidden_size)


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first (SGLang's default)."""

    name = "lru"

    def key(self, node: TreeNode, now: int) -> int:
        return node.last_access


@register_policy
class LFUPolicy(EvictionPolicy):
    """Least frequently used first, least recent among equals."""

    name = "lfu"

    def key(self, node: TreeNode, now: int) -> tuple[int, int]:
        return node.hit_count, node.last_access


@register_policy
class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: nodes used by fewer than `protected_hits` admissions (probationary) go
    before the rest (protected), LRU within each segment; a one-off scan cannot flush the
    prefixes that were reused."""

    name = "slru"

    def __init__(self, protected_hits: int = 2) -> None:
        self.protected_hits = protected_hits

    def key(self, node: TreeNode, now: int) -> tuple[int, int]:
        return int(node.hit_count >= self.protected_hits), node.last_access


@register_policy
class PriorityPolicy(EvictionPolicy):
    """Request priority first, LRU among equals. vLLM's convention (lower value = more important,
    default 0), so the highest value is evicted first. SGLang's PriorityStrategy evicts the lowest
    value first because SGLang's scheduler treats higher values as more important by default."""

    name = "priority"

    def key(self, node: TreeNode, now: int) -> tuple[int, int]:
        return -node.priority, node.last_access


@register_policy
class CostAwarePolicy(EvictionPolicy):
    """Keeps what is dearest to recompute per slot held, weighted by reuse (cost-aware hyperbolic
    caching: value = hits x cost / idle time, smallest evicted first). The default: in the
    replays of `python -m engine.bench --cases hicache` it is the one policy never below lru (a
    shift in popularity included, where lfu falls below it).

    Recomputing a node's n tokens at positions depth .. depth+n-1 costs, per token, a constant
    part (the projections and MLP, ~2 x parameters FLOPs) plus attention over every earlier
    position (~4 x layers x hidden x position). Per token of the node that is
    `1 + mean position / attention_tokens`, where `attention_tokens` is the position at which a
    token's attention costs as much as its linear layers (~6 x hidden for a dense model; the
    default suits hidden ~1-2k). Every slot of one pool holds the same bytes, so per slot is per
    byte. The cost is multiplied by (hits + 1) and divided by the ticks since its last use, so a
    deep, reused prefix outlives a shallow one touched as recently, and nothing stays forever."""

    name = "cost_aware"

    def __init__(self, attention_tokens: float = 8192.0) -> None:
        self.attention_tokens = attention_tokens

    @classmethod
    def for_model(cls, hidden_size: int) -> CostAwarePolicy:
        return cls(6.0 * hidden_size) if hidden_size > 0 else cls()

    def key(self, node: TreeNode, now: int) -> float:
        mean_position = node.depth + (len(node.key) - 1) / 2
        cost_per_token = 1.0 + mean_position / self.attention_tokens
        return (node.hit_count + 1) * cost_per_token / (now - node.last_access + 1)
