"""Cluster: engine actors behind one router, on a new or an existing Ray cluster.

The engines are either the cluster's own (N actors it starts and owns: the Python API and the
batch job) or a fleet it follows (the engine replicas of the Serve deployment, deploy/engines.py:
engines join, drain and leave while it runs; every front end holds a Cluster on the same fleet).
Either way, each engine has an index that is never reused, and the router, the output channels
and the KV event streams are per index.

This module wires the parts together: membership.py (which engines), health.py (heartbeats),
channels.py (each engine's output and KV event streams, demultiplexed to the requests) and
request_stream.py (one request's life: routing, re-routing, deadline, abort)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.protocol import EngineInfo
from actors.stats import DPGroupStats, EngineActorStats
from cluster.channels import ENGINE_DIED, Channels, consume_outputs, follow_kv_events
from cluster.config import ClusterConfig
from cluster.health import health_loop, wait_ready
from cluster.membership import ACTOR_NAMESPACE, EngineSlot, FleetWatcher, OwnedEngines, ensure_ray
from cluster.request_stream import send_abort, stream_request
from cluster.routing import Router
from cluster.stats import ClusterStats
from engine import GenerateOutput, SamplingParams, StreamDelta
from engine.builtin_model import builtin_model_path
from engine.config import ModelConfig
from engine.engine import EngineStats, collect_output
from engine.inputs import InputProcessor
from engine.tokenizer import Tokenizer

__all__ = ["ACTOR_NAMESPACE", "Cluster", "ensure_ray"]


class Cluster:
    def __init__(self, config: ClusterConfig | None = None, fleet: Any = None, **kwargs: Any) -> None:
        """fleet: a handle to the Fleet deployment (deploy/engines.py) to follow its engines;
        None: start and own config.num_engines engines."""
        self.config = config if config is not None else ClusterConfig.from_kwargs(**kwargs)
        self._owns_ray = ensure_ray(self.config.address)
        self.engines: list[EngineSlot] = []
        self.owned = OwnedEngines()  # what this cluster started (stopped by shutdown)
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # guards the router, the engine list and the channels
        self.channels = Channels(self._lock)
        try:
            self._start(self.config, fleet)
        except BaseException:  # nothing started here may outlive a failed constructor
            self.shutdown()
            raise

    @property
    def coordinators(self) -> list:
        """The attention-DP groups' DPCoordinator actors, one per group (none in a fleet)."""
        return self.owned.coordinators

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
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="radixray-cluster-loop", daemon=True).start()
        if fleet is None:
            started = self.owned.start(cfg)
            with self._lock:
                for actor, info, name in started:
                    self._add_engine(actor, info, name)
        else:
            watcher = FleetWatcher(fleet, self._lock, self._add_engine, self.router.stop_accepting,
                                   self._retire_engine, self._closed)
            first = threading.Event()
            threading.Thread(target=watcher.run, args=(first,), name="radixray-fleet", daemon=True).start()
            if not first.wait(timeout=600):
                raise TimeoutError("no engine joined the fleet in time")
        infos = self.infos
        self.inputs = InputProcessor(self.tokenizer, ModelConfig.from_dir(model_path).vocab_size,
                                     min(i.max_context_len for i in infos), min(i.max_total_tokens for i in infos),
                                     limits=cfg.limits)
        self._health = threading.Thread(target=health_loop, name="radixray-health", daemon=True,
                                        args=(self.engines, self.router, self._lock, cfg.health_check_period_s,
                                              self._closed))
        self._health.start()

    # ---- membership ------------------------------------------------------------------------
    def _add_engine(self, actor: Any, info: EngineInfo, name: str) -> int:
        """Under self._lock: route to a new engine and start reading its output (and KV events)."""
        idx = self.router.add_engine(info.max_total_tokens, info.disaggregation_mode)
        engine = EngineSlot(actor, info, name)
        if not self.router.exact:  # its evictions count from now, before anything is routed there
            engine.first_beat = actor.heartbeat.remote()
        self.engines.append(engine)
        coros = [consume_outputs(engine, idx, self.consumer, self.channels, self._closed)]
        if self.router.exact:
            coros.append(follow_kv_events(engine, idx, self.consumer, self.router.kv_index, self._lock, self._closed))
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
            doomed = self.channels.on_engine_locked(idx)
        for fut in engine.consumers:
            fut.cancel()
        with self._lock:  # follow_kv_events applies nothing to a retired engine after this
            self.router.kv_index.clear(idx)
        for rid in doomed:
            self.channels.deliver(rid, ENGINE_DIED, idx)

    def dp_stats(self) -> list[DPGroupStats]:
        return ray.get([c.stats.remote() for c in self.coordinators], timeout=10)

    # ---- health ----------------------------------------------------------------------------
    def healthy(self) -> list[bool]:
        """Per engine in the fleet (retired ones left out): routable or not."""
        with self._lock:
            return [ld.healthy for ld, e in zip(self.router.loads, self.engines) if not e.retired]

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        with self._lock:
            live = [(i, e.actor) for i, e in enumerate(self.engines) if not e.retired]
        wait_ready([a for _, a in live], timeout_s)
        with self._lock:
            for i, _ in live:
                self.router.set_healthy(i, True)

    # ---- requests --------------------------------------------------------------------------
    def stream_ids(self, input_ids: list[int], params: SamplingParams,
                   rid: str | None = None, priority: int = 0) -> AsyncIterator[StreamDelta]:
        """Route one validated request and stream its deltas (request_stream.stream_request):
        re-routed if its engine dies before a token was streamed, an explicit error if after;
        closing the stream early aborts the request on its engine."""
        return stream_request(input_ids, params, rid, priority=priority, config=self.config, lock=self._lock, router=self.router,
                              channels=self.channels, engines=self.engines, consumer=self.consumer,
                              send_abort=self._send_abort)

    def abort(self, rid: str) -> None:
        """Abort a request in flight (its engine frees its KV); unknown ids are ignored."""
        idx = self.channels.engine_of(rid)
        if idx is not None:
            self._send_abort(idx, rid)

    def _send_abort(self, idx: int, rid: str) -> None:
        send_abort(self._loop, self.engines[idx].actor, idx, rid)

    async def stream(self, prompt: str | None = None, sampling_params: Any = None,
                     input_ids: list[int] | None = None, messages: list[dict] | None = None,
                     rid: str | None = None) -> AsyncIterator[StreamDelta]:
        prompts, params, _ = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        async with contextlib.aclosing(self.stream_ids(prompts[0], params[0], rid)) as deltas:
            async for delta in deltas:  # closed however the caller leaves: the request is aborted
                yield delta

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
                s = EngineActorStats(engine_id=e.info.engine_id, healthy=False, role=e.info.disaggregation_mode,
                                     engine=EngineStats(kv_total=e.info.max_total_tokens))
            engines.append(s)
        dp_groups: list[DPGroupStats] = []
        if self.coordinators:  # attention-DP: groups are runs of dp_size consecutive engines of dp_span
            first, count = self.config.dp_span
            for i, s in enumerate(engines):
                if first <= i < first + count:
                    s.dp_group = (i - first) // self.config.dp_size
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
        self.owned.stop()
        if self._loop is not None:
            time.sleep(0.05)  # let the cancelled consumers unwind before the loop stops
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
