"""The walk that every token radix tree shares: the engine's `RadixCache`, the router's
`PrefixTree` and the KV index's `CachedPaths` (cluster/). Each keeps its own nodes, because each
node owns something different (KV slots and lock refs; recency in the router's LRU order;
nothing but the path, for the index); the walk needs only `children` (first token -> child) and
`key` (the node's tokens, a list)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar


class TrieNode(Protocol):
    children: dict[int, TrieNode]
    key: list[int]


N = TypeVar("N", bound=TrieNode)


def common_prefix_len(key: list[int], tokens: list[int], start: int = 0, end: int | None = None) -> int:
    """How many leading tokens of `key` equal tokens[start:end]."""
    limit = min(len(key), (len(tokens) if end is None else end) - start)
    # A node matched whole is the common case: one comparison in C settles it.
    if key[:limit] == tokens[start:start + limit]:
        return limit
    n = 0
    while n < limit and key[n] == tokens[start + n]:
        n += 1
    return n


def descend(root: N, tokens: list[int], end: int, split: Callable[[N, N, int], N] | None = None) -> tuple[list[N], int]:
    """Follow tokens[:end] down from `root`: the nodes entered, in order, and how many tokens of
    tokens[:end] the tree holds.

    Every node but the last is matched whole. Without `split` the last may be matched in part
    (its key runs past the match). With it, a node the match ends inside of is split first:
    `split(parent, child, n)` puts a node holding child.key[:n] in child's place, with child (now
    holding the rest) below it, and returns that head, so the path ends exactly at the match."""
    path: list[N] = []
    node, i = root, 0
    while i < end:
        child = node.children.get(tokens[i])
        if child is None:
            break
        key = child.key
        n = len(key)
        if i + n > end or tokens[i:i + n] != key:  # the whole node is the common case: no call for it
            n = common_prefix_len(key, tokens, i, end)
            if n < len(key):
                path.append(child if split is None else split(node, child, n))
                return path, i + n
        path.append(child)
        node, i = child, i + n
    return path, i
