"""The per-engine channels between a Cluster and its engines: each engine's multiplexed output
stream, read by one consumer task that hands every delta to the request waiting for it (an
`Inbox` on that request's event loop), and its KV event stream, applied to the routing index."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

import msgspec

from actors.protocol import decode_delta_batch, decode_kv_batch, decode_kv_snapshot
from engine import StreamDelta

if TYPE_CHECKING:
    from cluster.kv_index import KVIndex
    from cluster.membership import EngineSlot

log = logging.getLogger("radixray.cluster")
ENGINE_DIED = object()  # queued to a request whose engine's output stream broke
TIMED_OUT = object()  # queued to a request when its deadline passes
FLUSH = object()  # queued to a request when its held tokens are due (the stream interval)


class Inbox:
    """One request's deliveries, read by its stream on the request's loop; `take` hands over
    everything delivered so far. While the reader holds tokens back (`quiet`: the stream
    interval), a delta that does not end the request is stored without waking it, so a stream
    costs one wake-up per event, not one per token; the end, errors and sentinels always wake it."""

    __slots__ = ("items", "quiet", "ready", "waiter")

    def __init__(self) -> None:
        self.items: list = []
        self.quiet = False
        self.ready = False
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        if self.quiet and type(item) is StreamDelta and item.finish_reason is None:
            return
        self.ready = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        """Cancel-safe: its only await is a plain future, which a cancellation cancels."""
        if not (self.ready or (self.items and not self.quiet)):
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        items, self.items, self.ready = self.items, [], False
        return items


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta carrying consecutive deltas of a request (the last one's counts and finish)."""
    if len(deltas) == 1:
        return deltas[0]
    lps = [d.logprobs for d in deltas if d.logprobs is not None]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return msgspec.structs.replace(deltas[-1], text="".join([d.text for d in deltas]),
                                   token_ids=[t for d in deltas for t in d.token_ids],
                                   logprobs=[x for lp in lps for x in lp] if lps else None,
                                   prompt_logprobs=prompt_logprobs)


def _put_all(items: list[tuple[Inbox, Any]]) -> None:
    for inbox, item in items:
        inbox.put_nowait(item)


class Channels:
    """Which engine each request in flight reads (and which instance of that engine took it),
    and delivery from the engines' consumers to the requests' inboxes. An item from engine i
    reaches a request only while the request is on engine i: a late message about an engine it
    has left (a re-route) is dropped."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock  # the cluster's lock: a request is picked and subscribed under one hold
        self.subs: dict[str, tuple[int, asyncio.AbstractEventLoop, Inbox]] = {}  # rid -> engine, loop, inbox
        self.where: dict[str, int] = {}  # rid -> engine, while in flight
        self.incarnation: dict[str, str] = {}  # rid -> the engine instance that took it

    def subscribe_locked(self, rid: str, engine: int, loop: asyncio.AbstractEventLoop, inbox: Inbox) -> None:
        """Route engine `engine`'s deliveries for `rid` to `inbox` on `loop`; the caller holds the lock."""
        self.subs[rid] = (engine, loop, inbox)
        self.where[rid] = engine

    def taken(self, rid: str, incarnation: str) -> None:
        """The engine's instance `incarnation` accepted `rid`."""
        with self.lock:
            self.incarnation[rid] = incarnation

    def unsubscribe(self, rid: str) -> None:
        with self.lock:
            self.subs.pop(rid, None)
            self.where.pop(rid, None)
            self.incarnation.pop(rid, None)

    def engine_of(self, rid: str) -> int | None:
        return self.where.get(rid)

    def on_engine_locked(self, engine: int, live: str | None = None) -> list[str]:
        """The requests on `engine`, but for those its live instance `live` took (None: all).
        A request whose submit has not answered yet counts as the live instance's."""
        return [rid for rid, (idx, _, _) in self.subs.items()
                if idx == engine and (live is None or self.incarnation.get(rid, live) != live)]

    def deliver(self, rid: str, item: Any, engine: int) -> None:
        """Hand engine `engine`'s item to the request, if the request is still on that engine."""
        sub = self.subs.get(rid)
        if sub is not None and sub[0] == engine:
            _, loop, inbox = sub
            loop.call_soon_threadsafe(inbox.put_nowait, item)

    def deliver_batch(self, deltas: list[StreamDelta], engine: int) -> None:
        """deliver for one engine step's deltas: one wake-up per requests' loop, not per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            sub = self.subs.get(delta.rid)
            if sub is not None and sub[0] == engine:
                by_loop.setdefault(sub[1], []).append((sub[2], delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


async def consume_outputs(slot: EngineSlot, i: int, consumer: str, channels: Channels,
                          closed: threading.Event) -> None:
    """Read engine i's multiplexed output stream (as `consumer`) until `closed`; when the stream
    breaks (the engine died), tell every request the dead instance took, then reopen the stream
    (Ray restarts the actor)."""
    actor = slot.actor
    while not closed.is_set():
        try:
            async for ref in actor.outputs.remote(consumer):
                channels.deliver_batch(decode_delta_batch(await ref), i)
        except Exception as e:  # RayActorError and friends: the engine is gone
            if closed.is_set():
                return
            log.warning("output stream of engine %d broke: %s", i, type(e).__name__)
        # Doom only requests taken by an instance that is gone: a break noticed late, after
        # Ray restarted the engine, must not fail requests the new instance holds. Nor those
        # routed here after the break was noticed: a submit to the dead instance raises in its
        # own stream.
        with channels.lock:
            before = set(channels.on_engine_locked(i))
        try:
            live = await asyncio.wait_for(actor.incarnation_id.remote(), timeout=5)
        except Exception:
            live = None  # dead, restarting or hung: every request it held is lost
        with channels.lock:
            doomed = [rid for rid in channels.on_engine_locked(i, live) if rid in before]
        for rid in doomed:
            channels.deliver(rid, ENGINE_DIED, i)
        await asyncio.sleep(0.2)


async def follow_kv_events(slot: EngineSlot, i: int, consumer: str, index: KVIndex, lock: threading.Lock,
                           closed: threading.Event) -> None:
    """Keep the routing index's view of engine i exact: apply its KV events in order, resync
    from a snapshot after a gap, a restart or at the start; clear it while the engine is gone
    (and for good once it is retired). `lock` guards the index."""
    actor = slot.actor
    while not closed.is_set():
        try:
            async for ref in actor.kv_events.remote(consumer):
                batch = decode_kv_batch(await ref)
                with lock:
                    if slot.retired:  # gone from the fleet: its view stays empty
                        return
                    in_sync = index.apply(i, batch)
                if not in_sync:
                    snapshot = decode_kv_snapshot(await actor.kv_snapshot.remote())
                    with lock:
                        if slot.retired:
                            return
                        index.reset(i, snapshot)
        except Exception as e:  # the engine died or is restarting
            if closed.is_set():
                return
            log.warning("KV event stream of engine %d broke: %s", i, type(e).__name__)
        with lock:
            index.clear(i)
        await asyncio.sleep(0.2)
