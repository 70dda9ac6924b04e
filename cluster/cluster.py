"""Cluster: engine actors behind one router, on a new or an existing Ray cluster.

The engines are either the cluster's own (N actors it starts and owns: the Python API and the
batch job) or a fleet it follows (the engine replicas of the Serve deployment, deploy/engines.py:
engines join, drain and leave while it runs; every front end holds a Cluster on the same fleet).
Either way, each engine has an index that is never reused, and the router, the output channels
and the KV event streams are per index."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.dp_coordinator import DPCoordinator
from actors.engine_actor import EngineActor
from actors.protocol import (
    EngineInfo,
    GenerateRequest,
    decode_delta_batch,
    decode_evictions,
    decode_kv_batch,
    decode_kv_snapshot,
    encode,
)
from actors.stats import DPGroupStats, EngineActorStats
from cluster.config import ClusterConfig
from cluster.routing import Router
from cluster.stats import ClusterStats
from engine import GenerateOutput, SamplingParams, StreamDelta
from engine.builtin_model import builtin_model_path
from engine.config import ModelConfig
from engine.engine import EngineStats, collect_output
from engine.errors import EngineDeadError, ErrorKind
from engine.inputs import InputProcessor
from engine.tokenizer import Tokenizer

log = logging.getLogger("radixray.cluster")
ACTOR_NAMESPACE = "radixray"
_ENGINE_DIED = object()  # queued to a request whose engine's output stream broke
_TIMED_OUT = object()  # queued to a request when its deadline passes
_FLUSH = object()  # queued to a request when its held tokens are due (the stream interval)
ABORT_CONFIRM_TIMEOUT_S = 10.0  # an abort not acknowledged by then is sent again
FLEET_GRACE_S = 15.0  # how long a replaced registry may not list a live engine (lease renewals)


def ensure_ray(address: str | None = None, log_to_driver: bool = False) -> bool:
    """Connect to Ray (address, RAY_ADDRESS) or start a local one. Returns whether we started it.
    log_to_driver: the actors' stderr (errors, engine tracebacks) is printed by this process."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return False
    # "local": always a new private cluster, never one found through /tmp/ray by accident.
    ray.init(address="local", include_dashboard=False, log_to_driver=log_to_driver)
    return True


def _engine_is_gone(error: ray.exceptions.RayError) -> bool:
    """The engine, not just this request, is lost: its actor died or its loop is dead."""
    if isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return True
    return isinstance(getattr(error, "cause", None), EngineDeadError)


def _put_all(items: list[tuple[_Inbox, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class _Inbox:
    """One request's deliveries, read by its stream_ids on the request's loop; `take` hands over
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


def _merge_all(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta carrying consecutive deltas of a request (the last one's counts and finish)."""
    if len(deltas) == 1:
        return deltas[0]
    lps = [d.logprobs for d in deltas if d.logprobs is not None]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return msgspec.structs.replace(deltas[-1], text="".join([d.text for d in deltas]),
                                   token_ids=[t for d in deltas for t in d.token_ids],
                                   logprobs=[x for lp in lps for x in lp] if lps else None,
                                   prompt_logprobs=prompt_logprobs)


def _error(rid: str, message: str, kind: ErrorKind, prompt_tokens: int = 0) -> StreamDelta:
    return StreamDelta(rid=rid, text="", token_ids=[], finish_reason="abort", prompt_tokens=prompt_tokens,
                       error=message, error_kind=kind)


@dataclass
class _Engine:
    """One engine the cluster routes to (index = its position in Cluster.engines)."""

    actor: Any
    info: EngineInfo
    name: str
    consumers: list = field(default_factory=list)  # its output and KV event readers
    first_beat: Any = None  # a heartbeat sent when it was added: where its evictions start for us
    retired: bool = False  # left the fleet: never routed to again


class Cluster:
    def __init__(self, config: ClusterConfig | None = None, fleet: Any = None, **kwargs: Any) -> None:
        """fleet: a handle to the Fleet deployment (deploy/engines.py) to follow its engines;
        None: start and own config.num_engines engines."""
        self.config = config if config is not None else ClusterConfig.from_kwargs(**kwargs)
        self._owns_ray = ensure_ray(self.config.address)
        self.pg = None
        self.engines: list[_Engine] = []
        self.coordinators: list = []
        self._owned: list = []  # the actors this cluster started (killed by shutdown)
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # guards the router and the engine list
        try:
            self._start(self.config, fleet)
        except BaseException:  # nothing started here may outlive a failed constructor
            self.shutdown()
            raise

    @property
    def actors(self) -> list:
        return [e.actor for e in self.engines]

    @property
    def infos(self) -> list[EngineInfo]:
        return [e.info for e in self.engines]

    @property
    def actor_names(self) -> list[str]:
        return [e.name for e in self.engines if not e.retired]

    def _start(self, cfg: ClusterConfig, fleet: Any) -> None:
        model_path = cfg.model_path or builtin_model_path()
        self.tokenizer = Tokenizer(model_path)
        # This cluster's name on every engine: its output channel and KV event stream there.
        self.consumer = uuid.uuid4().hex[:12]
        self.router = Router(cfg.routing, 0, policy_options=cfg.routing_options)
        self._where: dict[str, int] = {}  # request id -> engine, while in flight
        self._incarnation: dict[str, str] = {}  # request id -> the engine instance that took it
        self._subs: dict[str, tuple[int, asyncio.AbstractEventLoop, _Inbox]] = {}
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="radixray-cluster-loop", daemon=True).start()
        if fleet is None:
            self._start_engines(cfg)
        else:
            self._fleet_keys: dict[str, int] = {}
            first = threading.Event()
            threading.Thread(target=self._follow_fleet, args=(fleet, first), name="radixray-fleet",
                             daemon=True).start()
            if not first.wait(timeout=600):
                raise TimeoutError("no engine joined the fleet in time")
        infos = self.infos
        self.inputs = InputProcessor(self.tokenizer, ModelConfig.from_dir(model_path).vocab_size,
                                     min(i.max_context_len for i in infos), min(i.max_total_tokens for i in infos),
                                     limits=cfg.limits)
        self._health = threading.Thread(target=self._health_loop, name="radixray-health", daemon=True)
        self._health.start()

    def _add_engine(self, actor: Any, info: EngineInfo, name: str) -> int:
        """Under self._lock: route to a new engine and start reading its output (and KV events)."""
        idx = self.router.add_engine(info.max_total_tokens)
        engine = _Engine(actor, info, name)
        if not self.router.exact:  # its evictions count from now, before anything is routed there
            engine.first_beat = actor.heartbeat.remote()
        self.engines.append(engine)
        coros = [self._consume(idx)] + ([self._follow_kv(idx)] if self.router.exact else [])
        engine.consumers = [asyncio.run_coroutine_threadsafe(c, self._loop) for c in coros]
        return idx

    def _retire_engine(self, idx: int) -> None:
        """The engine left the fleet: its requests that are still here re-route or fail."""
        with self._lock:
            engine = self.engines[idx]
            if engine.retired:
                return
            engine.retired = True
            self.router.stop_accepting(idx)
            self.router.set_healthy(idx, False)
            doomed = [rid for rid, (i, _, _) in self._subs.items() if i == idx]
        for fut in engine.consumers:
            fut.cancel()
        with self._lock:  # _follow_kv applies nothing to a retired engine after this
            self.router.kv_index.clear(idx)
        for rid in doomed:
            self._deliver(rid, _ENGINE_DIED, idx)

    def _follow_fleet(self, fleet: Any, first: threading.Event) -> None:
        """Apply the fleet's member list whenever it changes (a long poll on the registry)."""
        version = None
        missing: dict[str, tuple[str, float]] = {}  # key -> (registry instance, time) first missed
        known_registry: dict[str, str] = {}  # key -> the registry instance that last listed it
        while not self._closed.is_set():
            try:
                version, members = fleet.watch.remote(version).result(timeout_s=60)
            except Exception as e:  # the registry is restarting
                if self._closed.is_set():
                    return
                log.warning("fleet watch failed: %s", type(e).__name__)
                time.sleep(1.0)
                continue
            seen = set()
            for key, engine_id, actor, info, state in members:
                seen.add(key)
                with self._lock:
                    idx = self._fleet_keys.get(key)
                    if idx is None:
                        info = msgspec.msgpack.decode(info, type=EngineInfo)
                        idx = self._fleet_keys[key] = self._add_engine(actor, info, info.actor_name or key)
                        log.info("engine %d joined (index %d)", engine_id, idx)
                    if state == "draining":
                        self.router.stop_accepting(idx)
            # An engine missing from the list has left, unless the registry itself was replaced:
            # its engines register again within a lease renewal, so only a longer absence counts.
            now = time.monotonic()
            registry = version[0]
            for key in [k for k in self._fleet_keys if k not in seen]:
                since = missing.setdefault(key, (registry, now))
                if since[0] == known_registry.get(key, registry) or now - since[1] > FLEET_GRACE_S:
                    missing.pop(key)
                    self._retire_engine(self._fleet_keys.pop(key))
            for key in seen:
                missing.pop(key, None)
                known_registry[key] = registry
            if self.engines:
                first.set()

    def _start_engines(self, cfg: ClusterConfig) -> None:
        use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        self.device = "cuda" if use_gpu else "cpu"
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": cfg.cpus_per_engine}
        self.pg = placement_group([bundle] * cfg.num_engines, strategy=cfg.placement_strategy)
        ray.get(self.pg.ready(), timeout=120)
        engine_cfg = msgspec.structs.asdict(cfg.engine_config(self.device))
        actor_cls = ray.remote(EngineActor)
        # Named (in namespace "radixray") so operators and tests can find a cluster's engines.
        self.cluster_id = uuid.uuid4().hex[:8]
        names = [f"radixray-{self.cluster_id}-engine-{i}" for i in range(cfg.num_engines)]
        self.coordinators, dp = self._make_dp_groups(cfg)
        for i in range(cfg.num_engines):  # one at a time: a failure leaves self._owned complete
            self._owned.append(actor_cls.options(
                name=names[i], namespace=ACTOR_NAMESPACE, lifetime=None,
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=cfg.max_restarts,
                max_task_retries=0, max_concurrency=10_000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(engine_cfg, i, dp[i]))
        infos = ray.get([a.info.remote() for a in self._owned], timeout=600)
        self._wait_healthy(self._owned, timeout_s=600)  # attention-DP members: once their group formed
        with self._lock:
            for actor, info, name in zip(self._owned, infos, names):
                self._add_engine(actor, info, name)

    @staticmethod
    def _make_dp_groups(cfg: ClusterConfig) -> tuple[list, list[dict | None]]:
        """Attention-DP: one DPCoordinator per group of dp_group_size consecutive engines."""
        if not cfg.dp_attention:
            return [], [None] * cfg.num_engines
        size = cfg.dp_group_size or cfg.num_engines
        coord_cls = ray.remote(DPCoordinator)
        coords = [coord_cls.options(num_cpus=0, max_restarts=-1).remote(g, size)
                  for g in range(cfg.num_engines // size)]
        return coords, [{"rank": i % size, "size": size, "coordinator": coords[i // size],
                         "stall_timeout_s": cfg.dp_stall_timeout_s} for i in range(cfg.num_engines)]

    def dp_stats(self) -> list[DPGroupStats]:
        return ray.get([c.stats.remote() for c in self.coordinators], timeout=10)

    # ---- health ----------------------------------------------------------------------------
    def _health_loop(self) -> None:
        period = self.config.health_check_period_s
        # Per engine: (instance, seq) of the last eviction read there. Only the approximate trees
        # need evictions: exact routing reads them with the other KV events.
        cursors: dict[int, tuple[str, int]] = {}
        while not self._closed.wait(period):
            with self._lock:
                live = [(i, e.actor, e.first_beat) for i, e in enumerate(self.engines) if not e.retired]
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
                with self._lock:
                    if not self.engines[i].retired:
                        self.router.set_healthy(i, reply is not None)
                    if reply is None or self.router.exact:
                        continue
                    known = cursors.get(i)
                    if reply.lost or (known is not None and known[0] != reply.incarnation):
                        self.router.forget(i)  # evictions were missed: its tree would be wrong
                    else:
                        self.router.evicted(i, reply.paths)
                    cursors[i] = (reply.incarnation, reply.seq)

    def healthy(self) -> list[bool]:
        """Per engine in the fleet (retired ones left out): routable or not."""
        with self._lock:
            return [ld.healthy for ld, e in zip(self.router.loads, self.engines) if not e.retired]

    @staticmethod
    def _wait_healthy(actors: list, timeout_s: float) -> None:
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

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        with self._lock:
            live = [(i, e.actor) for i, e in enumerate(self.engines) if not e.retired]
        self._wait_healthy([a for _, a in live], timeout_s)
        with self._lock:
            for i, _ in live:
                self.router.set_healthy(i, True)

    # ---- requests --------------------------------------------------------------------------
    async def stream_ids(self, input_ids: list[int], params: SamplingParams,
                         rid: str | None = None) -> AsyncIterator[StreamDelta]:
        """Route one validated request and stream its deltas. Re-routes if its engine dies
        before a token was streamed; ends with an explicit error if it dies after.

        Cancel-safe: the only awaits are queue.take() (a plain future) and the submit call, so a
        cancellation always reaches the `finally` that aborts the request on its engine (the
        deadline is a sentinel put on the queue by a timer, not asyncio.wait_for, which can
        swallow a cancellation that races with the item it waits for)."""
        rid = rid or uuid.uuid4().hex
        cost = len(input_ids) + params.max_new_tokens
        try:
            payload = encode(GenerateRequest(rid=rid, input_ids=input_ids, sampling_params=params))
        except (OverflowError, TypeError, ValueError) as e:
            yield _error(rid, f"invalid request: {e}", "invalid_request", len(input_ids))
            return
        loop = asyncio.get_running_loop()
        interval = self.config.stream_interval_s
        flush: asyncio.TimerHandle | None = None
        tried: set[int] = set()
        queue = _Inbox()
        timer = loop.call_later(self.config.request_timeout_s, lambda: queue.put_nowait(_TIMED_OUT))
        try:
            while True:
                # Picked and subscribed under one lock: an engine retired meanwhile either was
                # not picked or finds this request among those it must re-route.
                # Each attempt reads its own subscription: a late message about an earlier
                # engine is dropped by _deliver, never read as this attempt's.
                with self._lock:
                    idx = self.router.pick(input_ids, cost, exclude=frozenset(tried))
                    if idx is not None:
                        self._subscribe_locked(rid, idx, loop, queue)
                if idx is None:
                    yield _error(rid, "no engine available", "overloaded", len(input_ids))
                    return
                streamed = finished = rerouted = False
                try:
                    incarnation = await self.engines[idx].actor.submit.remote(payload, self.consumer)
                    with self._lock:
                        self._incarnation[rid] = incarnation
                    held: list[StreamDelta] = []  # tokens waiting out the stream interval
                    while not rerouted:
                        for item in await queue.take():
                            if item is _FLUSH:  # an interval since the last event
                                flush = None
                                if held:
                                    yield _merge_all(held)
                                    held = []
                                    flush = loop.call_later(interval, queue.put_nowait, _FLUSH)
                                else:  # nothing came meanwhile: the next delta goes out as it comes
                                    queue.quiet = False
                                continue
                            if item is _TIMED_OUT or item is _ENGINE_DIED:
                                if held:  # what was produced reaches the client first
                                    yield _merge_all(held)
                                    held = []
                                if item is _ENGINE_DIED:
                                    raise ray.exceptions.RayActorError()
                                yield _error(rid, f"request timed out after {self.config.request_timeout_s}s",
                                             "timeout", len(input_ids))
                                return
                            held.append(item)
                            finished = item.finish_reason is not None
                            if item.error_kind == "draining" and not streamed:  # handed back: elsewhere
                                rerouted = True
                                break
                            # The first tokens and the end go out at once; the rest at most once per
                            # stream interval, merged: after an event, deltas wait (without waking
                            # us) for the flush an interval later, unless the end comes first.
                            if finished or not queue.quiet:
                                delta = _merge_all(held)
                                held = []
                                streamed = streamed or bool(delta.token_ids)
                                yield delta
                                if finished:
                                    return
                                if streamed and interval > 0:
                                    queue.quiet = True
                                    flush = loop.call_later(interval, queue.put_nowait, _FLUSH)
                except ray.exceptions.TaskCancelledError:
                    # Inside a Serve request the submit is a child task of the request, which Serve
                    # cancels with it when the client goes away: the request was cancelled, not failed
                    # (an explicit end: our own task's cancellation may come later, or not at all).
                    yield _error(rid, "request cancelled", "aborted", len(input_ids))
                    return
                except ray.exceptions.RayError as e:  # the actor died, or its engine loop is dead
                    if not _engine_is_gone(e):  # this request's failure, not the engine's
                        log.error("request %s failed on engine %d", rid, idx, exc_info=e)
                        yield _error(rid, f"engine error: {type(e).__name__}", "engine_error", len(input_ids))
                        return
                    with self._lock:
                        self.router.set_healthy(idx, False)
                    if streamed:
                        yield _error(rid, f"engine {idx} died mid-stream: {type(e).__name__}", "engine_error",
                                     len(input_ids))
                        return
                    tried.add(idx)  # nothing streamed yet: try another engine
                    log.warning("engine %d died before streaming request %s; re-routing", idx, rid)
                finally:
                    if flush is not None:
                        flush.cancel()
                        flush = None
                    self._unsubscribe(rid)
                    if not finished:  # cancelled, timed out, or given up on: free its KV there
                        self._send_abort(idx, rid)
                    with self._lock:
                        self.router.done(idx, cost, input_ids)
                if rerouted:
                    tried.add(idx)
                    log.info("engine %d is draining; re-routing request %s", idx, rid)
                queue = _Inbox()
        finally:
            timer.cancel()

    # ---- the per-engine output channels ---------------------------------------------------
    def _subscribe_locked(self, rid: str, engine: int, loop: asyncio.AbstractEventLoop, queue: _Inbox) -> None:
        """Route engine `engine`'s deliveries for `rid` to `queue` on `loop`; the caller holds the lock."""
        self._subs[rid] = (engine, loop, queue)
        self._where[rid] = engine

    def _unsubscribe(self, rid: str) -> None:
        with self._lock:
            self._subs.pop(rid, None)
            self._where.pop(rid, None)
            self._incarnation.pop(rid, None)

    async def _follow_kv(self, i: int) -> None:
        """Keep the routing index's view of engine i exact: apply its KV events in order, resync
        from a snapshot after a gap, a restart or at the start; clear it while the engine is gone."""
        index = self.router.kv_index
        actor = self.engines[i].actor
        while not self._closed.is_set():
            try:
                async for ref in actor.kv_events.remote(self.consumer):
                    batch = decode_kv_batch(await ref)
                    with self._lock:
                        if self.engines[i].retired:  # gone from the fleet: its view stays empty
                            return
                        in_sync = index.apply(i, batch)
                    if not in_sync:
                        snapshot = decode_kv_snapshot(await actor.kv_snapshot.remote())
                        with self._lock:
                            if self.engines[i].retired:
                                return
                            index.reset(i, snapshot)
            except Exception as e:  # the engine died or is restarting
                if self._closed.is_set():
                    return
                log.warning("KV event stream of engine %d broke: %s", i, type(e).__name__)
            with self._lock:
                index.clear(i)
            await asyncio.sleep(0.2)

    def _deliver(self, rid: str, item: Any, engine: int) -> None:
        """Hand engine `engine`'s item to the request, if the request is still on that engine."""
        sub = self._subs.get(rid)
        if sub is not None and sub[0] == engine:
            _, loop, queue = sub
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _deliver_batch(self, deltas: list[StreamDelta], engine: int) -> None:
        """_deliver for one engine step's deltas: one wake-up per requests' loop, not per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            sub = self._subs.get(delta.rid)
            if sub is not None and sub[0] == engine:
                by_loop.setdefault(sub[1], []).append((sub[2], delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    async def _consume(self, i: int) -> None:
        """Read engine i's multiplexed output stream for the cluster's lifetime; when the engine
        dies, tell every request routed to it, then reopen the stream (Ray restarts the actor)."""
        actor = self.engines[i].actor
        while not self._closed.is_set():
            try:
                async for ref in actor.outputs.remote(self.consumer):
                    self._deliver_batch(decode_delta_batch(await ref), i)
            except Exception as e:  # RayActorError and friends: the engine is gone
                if self._closed.is_set():
                    return
                log.warning("output stream of engine %d broke: %s", i, type(e).__name__)
            # Doom only requests taken by an instance that is gone: a break noticed late, after
            # Ray restarted the engine, must not fail requests the new instance holds.
            try:
                live = await asyncio.wait_for(actor.incarnation_id.remote(), timeout=5)
            except Exception:
                live = None  # dead, restarting or hung: every request on it is lost
            with self._lock:
                doomed = [rid for rid, (idx, _, _) in self._subs.items()
                          if idx == i and (live is None or self._incarnation.get(rid, live) != live)]
            for rid in doomed:
                self._deliver(rid, _ENGINE_DIED, i)
            await asyncio.sleep(0.2)

    def abort(self, rid: str) -> None:
        """Abort a request in flight (its engine frees its KV); unknown ids are ignored."""
        idx = self._where.get(rid)
        if idx is not None:
            self._send_abort(idx, rid)

    def _send_abort(self, idx: int, rid: str) -> None:
        """Abort `rid` on engine idx from the cluster's own loop, until the engine confirms it.

        Not from the caller's context: inside a Ray Serve request, an actor call is a child task
        of that request (Ray keeps an async actor's current task in a context variable), and when
        the client goes away Serve cancels the request *recursively*, which can cancel the abort
        itself before the engine runs it. So: another thread, and an empty context."""
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._abort_confirmed(idx, rid)),
                                        context=contextvars.Context())

    async def _abort_confirmed(self, idx: int, rid: str, attempts: int = 5) -> None:
        for _ in range(attempts):
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.engines[idx].actor.abort.remote(rid).future()),
                                       timeout=ABORT_CONFIRM_TIMEOUT_S)
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                return  # the engine is gone, and the request with it
            except Exception as e:  # cancelled or lost on the way, or slow: send it again
                log.warning("abort of %s on engine %d not confirmed (%s); sending it again", rid, idx,
                            type(e).__name__)
        log.error("abort of %s on engine %d was never confirmed", rid, idx)

    async def stream(self, prompt: str | None = None, sampling_params: Any = None,
                     input_ids: list[int] | None = None, messages: list[dict] | None = None,
                     rid: str | None = None) -> AsyncIterator[StreamDelta]:
        prompts, params, _ = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        async with contextlib.aclosing(self.stream_ids(prompts[0], params[0], rid)) as deltas:
            async for delta in deltas:  # closed however the caller leaves: the request is aborted
                yield delta

    async def generate_async(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                             messages: Any = None) -> GenerateOutput | list[GenerateOutput]:
        return await self._generate(*self.inputs.prepare(prompt, input_ids, messages, sampling_params))

    async def _generate(self, prompts: list[list[int]], params: list[SamplingParams],
                        single: bool) -> GenerateOutput | list[GenerateOutput]:
        async def one(ids: list[int], p: SamplingParams) -> GenerateOutput:
            rid = uuid.uuid4().hex
            return collect_output(rid, [d async for d in self.stream_ids(ids, p, rid)])

        outs = await asyncio.gather(*(one(ids, p) for ids, p in zip(prompts, params)))
        return outs[0] if single else list(outs)

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 messages: Any = None) -> GenerateOutput | list[GenerateOutput]:
        """Same shapes as Engine.generate; blocks the calling thread. Bad input raises here."""
        prepared = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        return self.run(self._generate(*prepared))

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the cluster's own event loop and wait for it (sync callers)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> ClusterStats:
        with self._lock:
            live = [(i, e) for i, e in enumerate(self.engines) if not e.retired]
            healthy = {i: self.router.loads[i].healthy for i, _ in live}
        refs = [(i, e, e.actor.stats.remote()) for i, e in live]
        engines: list[EngineActorStats] = []
        for i, e, ref in refs:
            try:
                s = ray.get(ref, timeout=10)
                s.healthy = s.healthy and healthy[i]  # its loop lives, and heartbeats agree
            except Exception:  # unreachable: zeros, except the pool size we know from its info
                s = EngineActorStats(engine_id=e.info.engine_id, healthy=False,
                                     engine=EngineStats(kv_total=e.info.max_total_tokens))
            engines.append(s)
        dp_groups: list[DPGroupStats] = []
        if self.coordinators:  # attention-DP: groups are runs of dp_group_size consecutive engines
            size = self.config.dp_group_size or self.config.num_engines
            for i, s in enumerate(engines):
                s.dp_group = i // size
            with contextlib.suppress(Exception):  # a restarting coordinator: the engines still report
                dp_groups = self.dp_stats()
        with self._lock:
            routing = self.router.stats()
        # Per-engine routing figures of the engines in the fleet, in the order of `engines`.
        keep = [i for i, _ in live]
        routing.decisions = [routing.decisions[i] for i in keep]
        for name in ("events_applied", "resyncs", "cached_tokens"):
            values = getattr(routing.kv_index, name)
            setattr(routing.kv_index, name, [values[i] for i in keep])
        return ClusterStats(engines=engines, routing=routing, dp_groups=dp_groups)

    def check_memory(self) -> list[EngineStats]:
        """Every engine's idle memory invariant (waits for idleness; raises if broken)."""
        with self._lock:
            live = [e.actor for e in self.engines if not e.retired]
        return ray.get([a.check_memory.remote() for a in live], timeout=120)

    def shutdown(self) -> None:
        """Stop everything this cluster started (also what a failed constructor got to)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for e in self.engines:
            for fut in e.consumers:
                fut.cancel()
        for a in self._owned + self.coordinators:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self._loop is not None:
            time.sleep(0.05)  # let the cancelled consumers unwind before the loop stops
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
