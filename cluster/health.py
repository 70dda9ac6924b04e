"""Engine health: the heartbeat loop that takes engines out of routing while they do not answer
(and hands their evictions to the approximate prefix trees), and the wait for engines to be ready."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import ray

from actors.protocol import decode_evictions
from cluster.routing import Router

if TYPE_CHECKING:
    from cluster.membership import EngineSlot


def wait_ready(actors: list, timeout_s: float) -> None:
    """Until every actor's ready() is True; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        refs = [a.ready.remote() for a in actors]  # False, not an error, while a DP group forms
        ready = True
        for ref in refs:  # each one read: an error left unread is printed as "unhandled"
            try:
                ready = ray.get(ref, timeout=5) and ready
            except Exception:  # dead or restarting: ask again
                ready = False
        if ready:
            return
        time.sleep(0.2)
    raise TimeoutError("engines did not become healthy in time")


def health_loop(engines: list[EngineSlot], router: Router, lock: threading.Lock, period: float,
                closed: threading.Event) -> None:
    """Heartbeat every engine in `engines` (a list that grows as engines join) each period until
    `closed`: one that does not answer is unhealthy (not routed to) until it does. `lock` guards
    the router and the engine list."""
    # Per engine: (instance, seq) of the last eviction read there. Only the approximate trees
    # need evictions: exact routing reads them with the other KV events.
    cursors: dict[int, tuple[str, int]] = {}
    while not closed.wait(period):
        with lock:
            live = [(i, e.actor, e.first_beat) for i, e in enumerate(engines) if not e.retired]
        refs = []
        for i, actor, first in live:
            if i not in cursors and first is not None:
                with contextlib.suppress(Exception):  # not healthy then: start from the next reply
                    reply = decode_evictions(ray.get(first, timeout=max(2.0, 5 * period)))
                    cursors[i] = (reply.incarnation, reply.seq)
            incarnation, seq = cursors.get(i, ("", -1))
            refs.append((i, actor.heartbeat.remote(seq, incarnation)))
        for i, ref in refs:
            try:
                reply = decode_evictions(ray.get(ref, timeout=max(2.0, 5 * period)))
            except Exception:  # dead, restarting or hung: out of routing until it answers
                reply = None
            with lock:
                if not engines[i].retired:
                    router.set_healthy(i, reply is not None)
                if reply is None or router.exact:
                    continue
                known = cursors.get(i)
                if reply.lost or (known is not None and known[0] != reply.incarnation):
                    router.forget(i)  # evictions were missed: its tree would be wrong
                else:
                    router.evicted(i, reply.paths)
                cursors[i] = (reply.incarnation, reply.seq)
