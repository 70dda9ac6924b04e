"""The routing index: what each engine's prefix cache holds, exactly, from the engines' own KV
events (see engine.cache_manager.KVEvent), not from guesses about what was routed where; and
the prompts of the requests each engine has queued or running, whichever front end sent them.

Each engine numbers its events (per actor instance). The index applies them in order; a gap (an
event lost, an engine restarted) marks the engine stale until a snapshot of its cache resyncs
it. A stale engine matches nothing, so routing falls back to load for it meanwhile.

With the hierarchical cache (engine/hicache) events name their tier (`KVEvent.medium`): per
engine the index keeps what its KV pool holds ("device") and what its host tier holds ("host": a
load away), and, once for every engine, what the shared storage tier holds ("storage": any
engine that reaches it loads those pages; never removed by events, so that view is bounded and
forgotten when full: a forgotten prefix only looks like a recompute to the router).

A LoRA adapter's KV is shared only under that adapter (events name it: `KVEvent.lora_name`): the
index files an adapter's paths under a root token of its own (`adapter_path`), so a match for one
adapter (or the base model) never counts another's."""

from __future__ import annotations

import msgspec

from actors.protocol import KVEventBatch, KVSnapshot, adapter_path
from engine.token_trie import descend


class _Node:
    __slots__ = ("children", "key")

    def __init__(self, key: list[int]) -> None:
        self.children: dict[int, _Node] = {}
        self.key = key


class CachedPaths:
    """A token-level radix tree of the paths one engine's cache holds: inserts and removals as
    the engine reports them, and longest-prefix matches.

    A replica of the engine's RadixCache shape, not of its contents: no KV slots, locks or
    recency, because the engine decides what goes (its "removed" events say), and nothing is
    guessed, so there is nothing to trim (unlike the router's PrefixTree). Its nodes hold only
    their tokens. It shares the walk (engine.token_trie.descend)."""

    def __init__(self) -> None:
        self.root = _Node([])
        self.size = 0  # tokens held

    def _descend(self, path: list[int], depth: int) -> tuple[_Node, int]:
        """Follow path[:depth] as far as the tree holds it, splitting the node it stops inside
        of; returns the node reached and how many tokens that is."""
        nodes, i = descend(self.root, path, depth, self._split)
        return (nodes[-1] if nodes else self.root), i

    @staticmethod
    def _split(parent: _Node, child: _Node, n: int) -> _Node:
        head = _Node(child.key[:n])
        parent.children[child.key[0]] = head
        child.key = child.key[n:]
        head.children[child.key[0]] = child
        return head

    def insert(self, path: list[int]) -> None:
        node, i = self._descend(path, len(path))
        if i < len(path):
            node.children[path[i]] = _Node(path[i:])
            self.size += len(path) - i

    def remove(self, path: list[int], start: int) -> None:
        """The engine dropped path[start:] (a leaf of its tree: nothing below it)."""
        if start >= len(path):
            return
        parent, depth = self._descend(path, start)
        if depth < start:  # not held
            return
        child = parent.children.pop(path[start], None)
        if child is not None:
            self.size -= self._tokens(child)

    @staticmethod
    def _tokens(node: _Node) -> int:
        total, stack = 0, [node]
        while stack:
            n = stack.pop()
            total += len(n.key)
            stack.extend(n.children.values())
        return total

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the engine holds."""
        return descend(self.root, tokens, len(tokens))[1]


class InFlightPrompts:
    """Prompts of requests on one engine and not finished yet (a counted token trie): their KV
    is being computed there, so a request sharing their head should follow them before any
    "stored" event says so.

    One node per token, not a radix tree: each token counts the prompts that pass it, and the
    count changes inside what would be one radix node (where a prompt ends or branches off), so
    the nodes would split on adds and be left split by discards. It holds only the prompts in
    flight: small, and emptied as they end. A discard stops where a count falls to zero and
    drops the rest of that path at once."""

    def __init__(self) -> None:
        self.root: dict[int, list] = {}  # token -> [count, children]
        self.tokens = 0  # of those prompts (waiting or already running: a load signal, not work left)

    def add(self, tokens: list[int]) -> None:
        """One more prompt (each add is paired with one discard of the same tokens)."""
        self.tokens += len(tokens)
        children = self.root
        for t in tokens:
            node = children.get(t)
            if node is None:
                node = children[t] = [0, {}]
            node[0] += 1
            children = node[1]

    def discard(self, tokens: list[int]) -> None:
        self.tokens -= len(tokens)
        children = self.root
        for t in tokens:
            node = children.get(t)
            if node is None:
                return
            node[0] -= 1
            if node[0] == 0:  # nothing else passes here: drop the rest of this path at once
                del children[t]
                return
            children = node[1]

    def match(self, tokens: list[int]) -> int:
        children, n = self.root, 0
        for t in tokens:
            node = children.get(t)
            if node is None:
                break
            children, n = node[1], n + 1
        return n


class _EngineView:
    __slots__ = ("host", "incarnation", "next_seq", "paths", "queued", "stale")

    def __init__(self) -> None:
        self.incarnation: str | None = None
        self.next_seq = 1
        self.paths = CachedPaths()  # the device pool
        self.host = CachedPaths()  # the host tier (a path's head may be on the device only)
        self.queued = InFlightPrompts()  # every front end's requests there ("queued", not "done")
        self.stale = True  # nothing known until the first event from seq 1 or a snapshot


class KVIndexStats(msgspec.Struct, kw_only=True):
    events_applied: list[int]  # per engine
    resyncs: list[int]  # snapshots applied per engine (after a gap, a restart or at start)
    cached_tokens: list[int]  # what the index believes each engine holds
    host_tokens: list[int] = []  # ... in its host tier
    storage_tokens: int = 0  # what the shared storage tier holds, by the index


class KVIndex:
    """Every engine's cached paths, kept exact by its event stream, plus the prompts in flight
    on it (routed, not finished)."""

    def __init__(self, num_engines: int, storage_capacity: int = 1 << 20) -> None:
        self.views = [_EngineView() for _ in range(num_engines)]
        self.storage = CachedPaths()  # the storage tier every engine shares
        self.storage_capacity = storage_capacity  # tokens; past it the storage view starts over
        self.in_flight = [InFlightPrompts() for _ in range(num_engines)]
        self.events_applied = [0] * num_engines
        self.resyncs = [0] * num_engines

    def add_engine(self) -> None:
        self.views.append(_EngineView())
        self.in_flight.append(InFlightPrompts())
        self.events_applied.append(0)
        self.resyncs.append(0)

    def apply(self, engine: int, batch: KVEventBatch) -> bool:
        """Apply a batch of engine `engine`'s events. False: a gap or another instance; the
        caller resyncs from a snapshot (until then the engine matches nothing)."""
        view = self.views[engine]
        if batch.incarnation != view.incarnation:
            if batch.first_seq != 1:  # a new instance seen mid-stream
                self.clear(engine)
                return False
            self.views[engine] = view = _EngineView()
            view.incarnation, view.stale = batch.incarnation, False
        if view.stale:
            return False
        for seq, event in enumerate(batch.events, batch.first_seq):
            if seq < view.next_seq:
                continue  # already in the snapshot
            if seq > view.next_seq:
                view.stale = True
                return False
            lora = getattr(event, "lora_name", None)
            path = adapter_path(event.token_ids, lora)
            if event.kind == "stored":
                self._tier(view, event.medium).insert(path)
                if self.storage.size > self.storage_capacity:
                    self.storage = CachedPaths()
            elif event.kind == "removed":
                self._tier(view, event.medium).remove(path, event.start + (lora is not None))
            elif event.kind == "queued":
                view.queued.add(path)
            else:
                view.queued.discard(path)
            view.next_seq = seq + 1
            self.events_applied[engine] += 1
        return True

    def _tier(self, view: _EngineView, medium: str) -> CachedPaths:
        if medium == "host":
            return view.host
        return self.storage if medium == "storage" else view.paths

    def reset(self, engine: int, snapshot: KVSnapshot) -> None:
        """Replace the engine's view by a snapshot; events after `snapshot.seq` apply on top. A
        snapshot's `host_paths` (if it has them) are its host tier's."""
        view = _EngineView()
        view.incarnation, view.next_seq, view.stale = snapshot.incarnation, snapshot.seq + 1, False
        for path in snapshot.paths:
            view.paths.insert(path)
        for path in getattr(snapshot, "host_paths", ()):
            view.host.insert(path)
        for prompt in snapshot.queued:
            view.queued.add(prompt)
        self.views[engine] = view
        self.resyncs[engine] += 1

    def clear(self, engine: int) -> None:
        """The engine is gone or restarting: it holds nothing we know of."""
        self.views[engine] = _EngineView()

    def match(self, engine: int, tokens: list[int], lora_name: str | None = None) -> int:
        """Leading tokens the engine holds in its cache under LoRA adapter `lora_name` (None:
        the base model); 0 while its view is stale."""
        view = self.views[engine]
        if view.stale:
            return 0
        if lora_name is None:
            return view.paths.match(tokens)
        return max(view.paths.match(adapter_path(tokens, lora_name)) - 1, 0)

    def match_with_in_flight(self, engine: int, tokens: list[int]) -> int:
        """Leading tokens the engine holds or is computing for a request in flight: one it
        reported queued (from any front end), or one this router sent there and that has not
        ended (the engine's report of it may not have arrived yet)."""
        view = self.views[engine]
        queued = 0 if view.stale else view.queued.match(tokens)
        return max(self.match(engine, tokens), queued, self.in_flight[engine].match(tokens))

    def match_tiers(self, engine: int, tokens: list[int]) -> tuple[int, int, int]:
        """Leading tokens of `tokens` the engine has (device, held or computing for a request in
        flight: `match_with_in_flight`), has within a load from its host tier, and could load from
        the shared storage tier; each at least the one before (0, 0, storage while stale)."""
        view = self.views[engine]
        device = self.match_with_in_flight(engine, tokens)
        host = device if view.stale else max(device, view.host.match(tokens))
        return device, host, max(host, self.storage.match(tokens))

    def cached_tokens(self, engine: int) -> int:
        """Tokens the engine's cache holds, by the index (a stale view's last known size)."""
        return self.views[engine].paths.size

    def queued_tokens(self, engine: int) -> int:
        """Prompt tokens of the requests the engine reported queued or running (every front end's)."""
        view = self.views[engine]
        return 0 if view.stale else view.queued.tokens

    def stats(self) -> KVIndexStats:
        return KVIndexStats(events_applied=list(self.events_applied), resyncs=list(self.resyncs),
                            cached_tokens=[v.paths.size for v in self.views],
                            host_tokens=[v.host.size for v in self.views], storage_tokens=self.storage.size)
