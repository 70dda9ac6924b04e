"""Cluster: N engine actors behind one router, on a new or an existing Ray cluster."""

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
ABORT_CONFIRM_TIMEOUT_S = 10.0  # an abort not acknowledged by then is sent again


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


def _error(rid: str, message: str, kind: ErrorKind, prompt_tokens: int = 0) -> StreamDelta:
    return StreamDelta(rid=rid, text="", token_ids=[], finish_reason="abort", prompt_tokens=prompt_tokens,
                       error=message, error_kind=kind)


class Cluster:
    def __init__(self, config: ClusterConfig | None = None, **kwargs: Any) -> None:
        self.config = config if config is not None else ClusterConfig.from_kwargs(**kwargs)
        self._owns_ray = ensure_ray(self.config.address)
        self.pg = None
        self.actors: list = []
        self.coordinators: list = []
        self._consumers: list = []
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._start(self.config)
        except BaseException:  # nothing started here may outlive a failed constructor
            self.shutdown()
            raise

    def _start(self, cfg: ClusterConfig) -> None:
        use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        self.device = "cuda" if use_gpu else "cpu"
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": cfg.cpus_per_engine}
        self.pg = placement_group([bundle] * cfg.num_engines, strategy=cfg.placement_strategy)
        ray.get(self.pg.ready(), timeout=120)
        engine_cfg = msgspec.structs.asdict(cfg.engine_config(self.device))
        actor_cls = ray.remote(EngineActor)
        # Named (in namespace "radixray") so operators and tests can find a cluster's engines.
        self.cluster_id = uuid.uuid4().hex[:8]
        self.actor_names = [f"radixray-{self.cluster_id}-engine-{i}" for i in range(cfg.num_engines)]
        self.coordinators, dp = self._make_dp_groups(cfg)
        for i in range(cfg.num_engines):  # one at a time: a failure leaves self.actors complete
            self.actors.append(actor_cls.options(
                name=self.actor_names[i], namespace=ACTOR_NAMESPACE, lifetime=None,
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=cfg.max_restarts,
                max_task_retries=0, max_concurrency=10_000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(engine_cfg, i, dp[i]))
        self.infos: list[EngineInfo] = ray.get([a.info.remote() for a in self.actors], timeout=600)
        model_path = cfg.model_path or builtin_model_path()
        model_cfg = ModelConfig.from_dir(model_path)
        self.tokenizer = Tokenizer(model_path)
        self.inputs = InputProcessor(self.tokenizer, model_cfg.vocab_size,
                                     min(i.max_context_len for i in self.infos),
                                     min(i.max_total_tokens for i in self.infos))
        self.router = Router(cfg.routing, cfg.num_engines, kv_capacity=min(i.max_total_tokens for i in self.infos),
                             policy_options=cfg.routing_options)
        self._lock = threading.Lock()  # guards the router (request loops and the health thread)
        self._where: dict[str, int] = {}  # request id -> engine, while in flight
        self._incarnation: dict[str, str] = {}  # request id -> the engine instance that took it
        self._subs: dict[str, tuple[int, asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="radixray-cluster-loop", daemon=True).start()
        self._health = threading.Thread(target=self._health_loop, name="radixray-health", daemon=True)
        self._health.start()
        self.wait_healthy(timeout_s=600)  # attention-DP members are healthy once their group has formed
        if self.router.exact:  # the index follows every engine's cache from the start
            with self._lock:
                self._start_consumers()

    @staticmethod
    def _make_dp_groups(cfg: ClusterConfig) -> tuple[list, list[dict | None]]:
        """Attention-DP: one DPCoordinator per group of dp_group_size consecutive engines."""
        if not cfg.dp_attention:
            return [], [None] * cfg.num_engines
        size = cfg.dp_group_size or cfg.num_engines
        coord_cls = ray.remote(DPCoordinator)
        coords = [coord_cls.options(num_cpus=0, max_restarts=-1).remote(g, size)
                  for g in range(cfg.num_engines // size)]
        return coords, [{"rank": i % size, "size": size, "coordinator": coords[i // size]}
                        for i in range(cfg.num_engines)]

    def dp_stats(self) -> list[DPGroupStats]:
        return ray.get([c.stats.remote() for c in self.coordinators], timeout=10)

    # ---- health ----------------------------------------------------------------------------
    def _health_loop(self) -> None:
        period = self.config.health_check_period_s
        while not self._closed.wait(period):
            refs = [a.heartbeat.remote() for a in self.actors]
            for i, ref in enumerate(refs):
                try:
                    evicted = ray.get(ref, timeout=max(2.0, 5 * period))
                    ok = True
                except Exception:  # dead, restarting or hung: out of routing until it answers
                    evicted, ok = [], False
                with self._lock:
                    self.router.set_healthy(i, ok)
                    if evicted:
                        self.router.evicted(i, evicted)

    def healthy(self) -> list[bool]:
        with self._lock:
            return [ld.healthy for ld in self.router.loads]

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get([a.check_health.remote() for a in self.actors], timeout=5)
                with self._lock:
                    for i in range(len(self.actors)):
                        self.router.set_healthy(i, True)
                return
            except Exception:
                time.sleep(0.2)
        raise TimeoutError("engines did not become healthy in time")

    # ---- requests --------------------------------------------------------------------------
    async def stream_ids(self, input_ids: list[int], params: SamplingParams,
                         rid: str | None = None) -> AsyncIterator[StreamDelta]:
        """Route one validated request and stream its deltas. Re-routes if its engine dies
        before a token was streamed; ends with an explicit error if it dies after.

        Cancel-safe: the only awaits are a plain queue.get() and the submit call, so a
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
        tried: set[int] = set()
        queue: asyncio.Queue = asyncio.Queue()
        timer = loop.call_later(self.config.request_timeout_s, lambda: queue.put_nowait(_TIMED_OUT))
        try:
            while True:
                with self._lock:
                    idx = self.router.pick(input_ids, cost, exclude=frozenset(tried))
                if idx is None:
                    yield _error(rid, "no engine available", "overloaded", len(input_ids))
                    return
                # Each attempt reads its own subscription: a late message about an earlier
                # engine is dropped by _deliver, never read as this attempt's.
                streamed = finished = False
                self._subscribe(rid, idx, queue)
                try:
                    incarnation = await self.actors[idx].submit.remote(payload)
                    with self._lock:
                        self._incarnation[rid] = incarnation
                    while True:
                        delta = await queue.get()
                        if delta is _TIMED_OUT:
                            yield _error(rid, f"request timed out after {self.config.request_timeout_s}s",
                                         "timeout", len(input_ids))
                            return
                        if delta is _ENGINE_DIED:
                            raise ray.exceptions.RayActorError()
                        streamed = streamed or bool(delta.token_ids)
                        finished = delta.finish_reason is not None
                        yield delta
                        if finished:
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
                    self._unsubscribe(rid)
                    if not finished:  # cancelled, timed out, or given up on: free its KV there
                        self._send_abort(idx, rid)
                    with self._lock:
                        self.router.done(idx, cost, input_ids)
                queue = asyncio.Queue()
        finally:
            timer.cancel()

    # ---- the per-engine output channels ---------------------------------------------------
    def _subscribe(self, rid: str, idx: int, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._subs[rid] = (idx, loop, queue)
            self._where[rid] = idx
            if not self._consumers:  # under the lock: started exactly once
                self._start_consumers()

    def _unsubscribe(self, rid: str) -> None:
        with self._lock:
            self._subs.pop(rid, None)
            self._where.pop(rid, None)
            self._incarnation.pop(rid, None)

    def _start_consumers(self) -> None:
        """Under self._lock: the per-engine output readers and, for exact routing, KV event readers."""
        if self._consumers:
            return
        coros = [self._consume(i) for i in range(len(self.actors))]
        if self.router.exact:
            coros += [self._follow_kv(i) for i in range(len(self.actors))]
        self._consumers = [asyncio.run_coroutine_threadsafe(c, self._loop) for c in coros]

    async def _follow_kv(self, i: int) -> None:
        """Keep the routing index's view of engine i exact: apply its KV events in order, resync
        from a snapshot after a gap, a restart or at the start; clear it while the engine is gone."""
        index = self.router.kv_index
        while not self._closed.is_set():
            try:
                async for ref in self.actors[i].kv_events.remote():
                    batch = decode_kv_batch(await ref)
                    with self._lock:
                        in_sync = index.apply(i, batch)
                    if not in_sync:
                        snapshot = decode_kv_snapshot(await self.actors[i].kv_snapshot.remote())
                        with self._lock:
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

    async def _consume(self, i: int) -> None:
        """Read engine i's multiplexed output stream for the cluster's lifetime; when the engine
        dies, tell every request routed to it, then reopen the stream (Ray restarts the actor)."""
        while not self._closed.is_set():
            try:
                async for ref in self.actors[i].outputs.remote():
                    for delta in decode_delta_batch(await ref):
                        self._deliver(delta.rid, delta, i)
            except Exception as e:  # RayActorError and friends: the engine is gone
                if self._closed.is_set():
                    return
                log.warning("output stream of engine %d broke: %s", i, type(e).__name__)
            # Doom only requests taken by an instance that is gone: a break noticed late, after
            # Ray restarted the engine, must not fail requests the new instance holds.
            try:
                live = await asyncio.wait_for(self.actors[i].incarnation_id.remote(), timeout=5)
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
                await asyncio.wait_for(asyncio.wrap_future(self.actors[idx].abort.remote(rid).future()),
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
        refs = [a.stats.remote() for a in self.actors]
        engines: list[EngineActorStats] = []
        healthy = self.healthy()
        for i, ref in enumerate(refs):
            try:
                s = ray.get(ref, timeout=10)
                s.healthy = s.healthy and healthy[i]  # its loop lives, and heartbeats agree
            except Exception:  # unreachable: zeros, except the pool size we know from its info
                s = EngineActorStats(engine_id=i, healthy=False,
                                     engine=EngineStats(kv_total=self.infos[i].max_total_tokens))
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
        return ClusterStats(engines=engines, routing=routing, dp_groups=dp_groups)

    def check_memory(self) -> list[EngineStats]:
        """Every engine's idle memory invariant (waits for idleness; raises if broken)."""
        return ray.get([a.check_memory.remote() for a in self.actors], timeout=120)

    def shutdown(self) -> None:
        """Stop everything this cluster started (also what a failed constructor got to)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for fut in self._consumers:
            fut.cancel()
        for a in self.actors + self.coordinators:
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
