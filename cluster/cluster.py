"""Cluster: engine actors behind one router, on a new or an existing Ray cluster.

The engines are either the cluster's own (N actors it starts and owns: the Python API and the
batch job) or a fleet it follows (the engine replicas of the Serve deployment, deploy/engines.py:
engines join, drain and leave while it runs; every front end holds a Cluster on the same fleet).
Either way, each engine has an index that is never reused, and the router, the output channels
and the KV event streams are per index.

This module wires the parts together: membership.py (which engines), health.py (heartbeats),
channels.py (each engine's output and KV event streams, demultiplexed to the requests) and
request_stream.py (one request's life: routing, re-routing, deadline, abort).

LoRA adapters: a request names its adapter (`lora_name`) and is routed only to engines that serve
it (the router's view of each engine's adapters: its reports and what was routed there, see
cluster/routing.py). `load_lora_adapter` / `unload_lora_adapter` apply to every engine of the
cluster, so every engine serves the same adapters; an adapter loaded through this Cluster is
loaded again on an engine that joins later or comes back after a restart."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.protocol import EngineInfo, LoRAAdapters, decode_lora_adapters, decode_lora_update
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
from engine.errors import InvalidRequestError
from engine.inputs import InputProcessor
from engine.lora import LoRAAdapterError, UnknownLoRAError
from engine.tokenizer import Tokenizer

__all__ = ["ACTOR_NAMESPACE", "Cluster", "ensure_ray"]
log = logging.getLogger("radixray.cluster")
LORA_CALL_TIMEOUT_S = 300.0  # loading an adapter reads (and checks) its files on every engine
LORA_REPORT_TIMEOUT_S = 10.0  # an engine's report of its adapters
LORA_REFRESH_S = 1.0  # an unknown adapter name asks the engines again at most this often


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
        # Adapters loaded at run time through this cluster: name -> (folder, pinned, load id),
        # loaded again on an engine that joins or restarts (lora_paths adapters it loads by
        # itself); the load ids unloaded through it, which a joining engine must not keep.
        self._runtime_loras: dict[str, tuple[str, bool, str]] = {}
        self._unloaded_loras: set[str] = set()
        self._lora_updates = threading.Lock()  # one load or unload at a time: each is all or nothing
        self._lora_refreshed = 0.0
        self._adapter_syncs: dict[int, concurrent.futures.Future] = {}  # engine -> its first adapter sync
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
        self.router = Router(cfg.routing, 0, policy_options=cfg.routing_options, on_recover=self._on_recover)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="radixray-cluster-loop", daemon=True).start()
        if fleet is None:
            started = self.owned.start(cfg)
            with self._lock:
                for actor, info, name in started:
                    self._add_engine(actor, info, name)
            for sync in self._adapter_syncs.values():  # their adapters are routable once this returns
                sync.result(timeout=60)
            self._adapter_syncs.clear()
        else:
            watcher = FleetWatcher(fleet, self._lock, self._add_engine, self.router.stop_accepting,
                                   self._retire_engine, self._closed)
            first = threading.Event()
            threading.Thread(target=watcher.run, args=(first,), name="radixray-fleet", daemon=True).start()
            if not first.wait(timeout=600):
                raise TimeoutError("no engine joined the fleet in time")
        infos = self.infos
        model_cfg = ModelConfig.from_dir(model_path)
        self.inputs = InputProcessor(self.tokenizer, model_cfg.vocab_size,
                                     min(i.max_context_len for i in infos), min(i.max_total_tokens for i in infos),
                                     limits=cfg.limits, dllm_block_size=model_cfg.dllm_block_size)
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
        self._adapter_syncs[idx] = asyncio.run_coroutine_threadsafe(self._sync_adapters(idx), self._loop)
        return idx

    def _on_recover(self, idx: int) -> None:
        """Under self._lock (the router calls it): engine idx answers again, perhaps restarted
        without the adapters loaded at run time."""
        asyncio.run_coroutine_threadsafe(self._sync_adapters(idx), self._loop)

    async def _sync_adapters(self, idx: int) -> None:
        """Load on engine idx the adapters loaded at run time that it lacks (through this front
        end, or through any other: as the fleet's other engines report them now), unload from it
        those whose load was unloaded anywhere (an unload that missed it while it joined), then
        take its adapters into the router's view."""
        engine = self.engines[idx]
        try:
            adapters = decode_lora_adapters(await engine.actor.lora_adapters.remote())
        except Exception as e:  # gone again: the next recovery syncs it
            log.warning("could not read engine %d's LoRA adapters: %s", idx, type(e).__name__)
            return
        if adapters.max_loaded:
            try:
                adapters = await self._restore_adapters(idx, adapters)
            except Exception as e:  # the router still takes what the engine serves now
                log.warning("could not bring engine %d's LoRA adapters up to date: %s", idx, type(e).__name__)
                with contextlib.suppress(Exception):
                    adapters = decode_lora_adapters(await engine.actor.lora_adapters.remote())
        self._take_adapters(idx, adapters)

    async def _restore_adapters(self, idx: int, adapters: LoRAAdapters) -> LoRAAdapters:
        """_sync_adapters' changes on engine idx; its adapters after them. A load is known by its
        fleet-wide id: loads unloaded anywhere go first (from the engine, and from this front
        end's list), then the engine gets what it lacks (the fleet's current loads first, this
        front end's own beside them), and the reports are read again after, so an unload that ran
        meanwhile (and missed this engine, not in its front end's list yet) is undone here."""
        engine = self.engines[idx]
        runtime, unloaded = await self._fleet_runtime_loras(idx)
        for name, entry in list(self._runtime_loras.items()):
            if entry[2] in unloaded:  # unloaded through another front end
                self._runtime_loras.pop(name, None)
        adapters = await self._unload_stale(engine, adapters, unloaded)
        wanted = dict(self._runtime_loras) | {n: e for n, e in runtime.items() if e[2] not in unloaded}
        for name, (path, pinned, load_id) in wanted.items():
            if name not in adapters.names:
                update = decode_lora_update(await engine.actor.load_lora_adapter.remote(name, path, pinned, load_id))
                if update.error:
                    log.warning("engine %d could not load LoRA adapter %r again: %s", idx, name, update.error)
                adapters = update.adapters
        _, unloaded = await self._fleet_runtime_loras(idx)
        return await self._unload_stale(engine, adapters, unloaded)

    @staticmethod
    async def _unload_stale(engine: EngineSlot, adapters: LoRAAdapters, unloaded: set[str]) -> LoRAAdapters:
        """Unload from `engine` its run-time loads whose ids are in `unloaded`."""
        for name, _, _, load_id in adapters.runtime:
            if load_id in unloaded:
                adapters = decode_lora_update(await engine.actor.unload_lora_adapter.remote(name)).adapters
        return adapters

    async def _fleet_runtime_loras(self, idx: int) -> tuple[dict[str, tuple[str, bool, str]], set[str]]:
        """The adapters the other live engines report loaded at run time (name -> (folder,
        pinned, load id); asked now, so an adapter unloaded meanwhile is not loaded again) and the
        load ids unloaded anywhere (theirs and this front end's); the engines that do not answer
        within LORA_REPORT_TIMEOUT_S (for all of them) add none."""
        with self._lock:
            others = [e.actor for i, e in enumerate(self.engines) if i != idx and not e.retired]
        runtime: dict[str, tuple[str, bool, str]] = {}
        unloaded = set(self._unloaded_loras)
        refs = [asyncio.ensure_future(actor.lora_adapters.remote()) for actor in others]
        if not refs:
            return runtime, unloaded
        done, pending = await asyncio.wait(refs, timeout=LORA_REPORT_TIMEOUT_S)
        for fut in pending:
            fut.cancel()
        for fut in done:
            with contextlib.suppress(Exception):
                report = decode_lora_adapters(fut.result())
                runtime.update({name: (path, pinned, load_id) for name, path, pinned, load_id in report.runtime})
                unloaded.update(report.unloaded)
        return runtime, unloaded

    def _take_adapters(self, idx: int, adapters: LoRAAdapters) -> None:
        with self._lock:
            if not self.engines[idx].retired:
                self.router.set_adapters(idx, adapters.names, adapters.resident, adapters.max_loaded)

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
                   rid: str | None = None, priority: int = 0, lora_name: str | None = None) -> AsyncIterator[StreamDelta]:
        """Route one validated request and stream its deltas (request_stream.stream_request):
        re-routed if its engine dies before a token was streamed, an explicit error if after;
        closing the stream early aborts the request on its engine. lora_name: its LoRA adapter
        (None: the base model), served by an engine it is routed to (see has_lora_adapter)."""
        return stream_request(input_ids, params, rid, priority=priority, lora_name=lora_name, config=self.config,
                              lock=self._lock, router=self.router, channels=self.channels, engines=self.engines,
                              consumer=self.consumer, send_abort=self._send_abort)

    def abort(self, rid: str) -> None:
        """Abort a request in flight (its engine frees its KV); unknown ids are ignored."""
        idx = self.channels.engine_of(rid)
        if idx is not None:
            self._send_abort(idx, rid)

    def _send_abort(self, idx: int, rid: str) -> None:
        send_abort(self._loop, self.engines[idx].actor, idx, rid)

    async def stream(self, prompt: str | None = None, sampling_params: Any = None,
                     input_ids: list[int] | None = None, messages: list[dict] | None = None,
                     rid: str | None = None, lora_name: str | None = None) -> AsyncIterator[StreamDelta]:
        prompts, params, _ = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        if lora_name is not None:  # (may ask the engines: off this loop)
            await asyncio.to_thread(self._check_adapters, [lora_name])
        async with contextlib.aclosing(self.stream_ids(prompts[0], params[0], rid, lora_name=lora_name)) as deltas:
            async for delta in deltas:  # closed however the caller leaves: the request is aborted
                yield delta

    async def _generate(self, prompts: list[list[int]], params: list[SamplingParams],
                        single: bool, names: list[str | None]) -> GenerateOutput | list[GenerateOutput]:
        async def one(ids: list[int], p: SamplingParams, name: str | None) -> GenerateOutput:
            rid = uuid.uuid4().hex
            return collect_output(rid, [d async for d in self.stream_ids(ids, p, rid, lora_name=name)])

        outs = await asyncio.gather(*(one(ids, p, name) for ids, p, name in zip(prompts, params, names)))
        return outs[0] if single else list(outs)

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 messages: Any = None, lora_name: str | None | list[str | None] = None
                 ) -> GenerateOutput | list[GenerateOutput]:
        """Same shapes as Engine.generate; blocks the calling thread. Bad input raises here.
        lora_name: the LoRA adapter (None: the base model), one for every prompt or one per
        prompt; an adapter no engine serves raises UnknownLoRAError before any request starts."""
        prompts, params, single = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        names = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(names) != len(prompts):
            raise InvalidRequestError("lora_name list must match the number of prompts", "model")
        self._check_adapters(names)
        return self.run(self._generate(prompts, params, single, names))

    def _check_adapters(self, names: list[str | None]) -> None:
        for name in dict.fromkeys(names):
            if name is None:
                continue
            if not isinstance(name, str):
                raise InvalidRequestError(f"lora_name must be a string, got {name!r}", "model")
            if not self.has_lora_adapter(name):
                raise UnknownLoRAError(name)

    # ---- LoRA adapters -----------------------------------------------------------------------
    def has_lora_adapter(self, name: str, refresh: bool = True) -> bool:
        """Whether an engine serves adapter `name`. refresh: a name the router does not know asks
        the engines again (blocking; at most once per LORA_REFRESH_S: another front end may have
        loaded it)."""
        with self._lock:
            if any(self.router.serves(i, name) for i in self.router.healthy()):
                return True
        if not refresh or time.monotonic() - self._lora_refreshed < LORA_REFRESH_S:
            return False
        self.refresh_lora_adapters()
        with self._lock:
            return any(self.router.serves(i, name) for i in self.router.healthy())

    def lora_adapters(self) -> list[str]:
        """The adapters the engines serve (sorted), as they reported them at most LORA_REFRESH_S
        ago (another front end may have loaded or unloaded one since)."""
        if time.monotonic() - self._lora_refreshed >= LORA_REFRESH_S:
            self.refresh_lora_adapters()
        with self._lock:
            return self.router.adapter_names()

    def refresh_lora_adapters(self) -> None:
        """Ask every engine for its adapters (the router's view of them), all at once, waiting
        at most 10 s for the lot."""
        self._lora_refreshed = time.monotonic()
        with self._lock:
            live = [(i, e.actor.lora_adapters.remote()) for i, e in enumerate(self.engines) if not e.retired]
        ready, _ = ray.wait([ref for _, ref in live], num_returns=len(live), timeout=10) if live else ([], [])
        ready = set(ready)
        for i, ref in live:
            try:
                if ref not in ready:
                    raise TimeoutError
                self._take_adapters(i, decode_lora_adapters(ray.get(ref)))
            except Exception as e:  # unreachable or slow: its last report stands
                log.warning("could not read engine %d's LoRA adapters: %s", i, type(e).__name__)

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Load the PEFT adapter in folder `path` as `name` on every engine (the engines need
        enable_lora or lora_paths; the folder must be readable where each engine runs). All or
        nothing: a bad adapter (LoRAAdapterError, naming it and the problem) is unloaded again
        from the engines that took it; an engine that does not answer gets it when it comes back.
        `pinned`: never evicted from the engines' host memory."""
        with self._lora_updates:
            self._load_lora_adapter(name, path, pinned)

    def _load_lora_adapter(self, name: str, path: str, pinned: bool) -> None:
        load_id = uuid.uuid4().hex  # this load on every engine, fleet-wide (what an unload names)
        with self._lock:
            live = [(i, e.actor.load_lora_adapter.remote(name, path, pinned, load_id))
                    for i, e in enumerate(self.engines) if not e.retired]
        loaded, error, unreachable = [], None, None
        for i, ref in live:
            try:
                update = decode_lora_update(ray.get(ref, timeout=LORA_CALL_TIMEOUT_S))
            except Exception as e:  # dead or restarting: loaded there when it answers again
                unreachable = e
                continue
            self._take_adapters(i, update.adapters)
            if update.error:
                error = error or update.error
            else:
                loaded.append(i)
        if error is None and not loaded and unreachable is not None:
            raise RuntimeError(f"no engine could load LoRA adapter {name!r}: {unreachable}") from unreachable
        if error is not None:
            for i in loaded:  # all or nothing
                with contextlib.suppress(Exception):
                    update = decode_lora_update(ray.get(self.engines[i].actor.unload_lora_adapter.remote(name),
                                                        timeout=LORA_CALL_TIMEOUT_S))
                    self._take_adapters(i, update.adapters)
            raise LoRAAdapterError(name, error.removeprefix(f"LoRA adapter {name!r}: "))
        self._runtime_loras[name] = (path, pinned, load_id)

    def unload_lora_adapter(self, name: str) -> bool:
        """Unload adapter `name` from every engine: new requests naming it are refused; running
        ones finish with it. True if it is gone everywhere now, False if it goes when they end.
        UnknownLoRAError if no engine serves it."""
        with self._lora_updates:
            return self._unload_lora_adapter(name)

    def _unload_lora_adapter(self, name: str) -> bool:
        entry = self._runtime_loras.pop(name, None)
        if entry is not None:
            self._unloaded_loras.add(entry[2])
        with self._lock:
            live = [(i, e.actor.unload_lora_adapter.remote(name)) for i, e in enumerate(self.engines) if not e.retired]
        found, gone, unreachable = False, True, None
        for i, ref in live:
            try:
                update = decode_lora_update(ray.get(ref, timeout=LORA_CALL_TIMEOUT_S))
            except Exception as e:  # dead or restarting: it forgets the adapter unless loaded at start
                log.warning("could not unload LoRA adapter %r from engine %d: %s", name, i, type(e).__name__)
                unreachable = e
                continue
            self._take_adapters(i, update.adapters)
            found = found or not update.unknown
            gone = gone and not update.draining
        if not found and unreachable is not None:
            raise RuntimeError(f"no engine could unload LoRA adapter {name!r}: {unreachable}") from unreachable
        if not found:
            raise UnknownLoRAError(name)
        return gone

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
