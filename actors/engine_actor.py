"""EngineActor: a Ray actor hosting one Engine whose loop runs on a background thread."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid
from collections import deque
from itertools import islice
from typing import Any

import msgspec
import ray

import actors.hicache_store  # noqa: F401  (registers the "ray" HiCache storage backend)
from actors.dp_coordinator import DPMember
from actors.kv_link import KVLink, LinkAddress, PrefillLinks
from actors.kv_transfer import RayPrefillSource, kv_bytes, payload_meta, payload_to_wire
from actors.protocol import (
    EngineInfo,
    Evictions,
    KVEventBatch,
    KVSnapshot,
    LoRAAdapters,
    LoRAUpdate,
    adapter_path,
    decode_request,
    encode,
    encode_batch,
)
from actors.stats import DPMemberStats, EngineActorStats
from actors.tp_worker import TPGang
from engine import Engine, EngineConfig, InvalidRequestError, StreamDelta
from engine.cache_manager import MEDIUMS, KVEvent
from engine.disaggregation import KVFetch, KVPoll, LocalKVChannel, submit_prefill
from engine.engine import EngineStats
from engine.logs import log_to_stderr
from engine.lora import LoRAAdapterError, UnknownLoRAError

# The eviction log every heartbeat reads from its own cursor: the newest paths, at most this
# many and this many tokens in all (a path runs from the root to the evicted node's first token).
MAX_PENDING_EVICTIONS = 4096
MAX_PENDING_EVICTION_TOKENS = 1 << 20
# KV events buffered for the kv_events() stream; past this the consumer is too slow: the buffer
# is dropped and the consumer, seeing a gap in the sequence, resyncs from a snapshot.
MAX_PENDING_KV_EVENTS = 65536


def _invalid(rid: str, prompt_tokens: int, error: InvalidRequestError) -> StreamDelta:
    return StreamDelta.aborted(rid, error=f"invalid request: {error}", kind="invalid_request",
                               prompt_tokens=prompt_tokens)


def _refused(rid: str, prompt_tokens: int) -> StreamDelta:
    return StreamDelta.aborted(rid, error="engine is draining", kind="draining", prompt_tokens=prompt_tokens)


# Load ids unloaded that an engine remembers (and reports): enough for any join racing an unload.
UNLOADED_LORAS_KEPT = 1024

class _Channel:
    """One consumer's items, filled from any thread and drained by one async reader: one
    wake-up per burst of items, not one per item."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: list = []
        self.lock = threading.Lock()
        self.ready = asyncio.Event()
        self.loop = loop

    def put(self, item: object) -> None:
        with self.lock:
            self.items.append(item)
            first = len(self.items) == 1
        if first:
            self.loop.call_soon_threadsafe(self.ready.set)

    async def take(self) -> list:
        await self.ready.wait()
        with self.lock:
            items, self.items = self.items, []
            self.ready.clear()
        return items


class EvictionLog:
    """The radix nodes an engine evicted, each as its token path up to the node's first token,
    numbered from 1, the newest kept (bounded in paths and tokens). Readers keep their own
    cursor (the seq they last got), so every reader sees every eviction; one whose next path
    was dropped is told it fell behind."""

    def __init__(self, max_paths: int = MAX_PENDING_EVICTIONS, max_tokens: int = MAX_PENDING_EVICTION_TOKENS) -> None:
        self.paths: deque[list[int]] = deque()
        self.max_paths, self.max_tokens = max_paths, max_tokens
        self.tokens = 0
        self.seq = 0  # of the newest path
        self.lock = threading.Lock()

    def append(self, path: list[int]) -> None:
        with self.lock:
            self.paths.append(path)
            self.tokens += len(path)
            self.seq += 1
            while len(self.paths) > self.max_paths or (self.tokens > self.max_tokens and len(self.paths) > 1):
                self.tokens -= len(self.paths.popleft())

    def after(self, cursor: int) -> tuple[int, list[list[int]], bool]:
        """The paths evicted after `cursor`: (the newest seq, those still held, whether any
        after the cursor was dropped)."""
        with self.lock:
            skip = cursor - (self.seq - len(self.paths))  # held paths at or before the cursor
            return self.seq, list(islice(self.paths, max(skip, 0), None)), skip < 0 or cursor > self.seq


class _KVStream:
    """One consumer's pending KV events, as runs of consecutive sequence numbers."""

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.pending = 0

    def add(self, seq: int, event: KVEvent) -> None:
        ch = self.channel
        with ch.lock:
            if self.pending >= MAX_PENDING_KV_EVENTS:  # too slow a reader: it will see a gap
                ch.items, self.pending = [], 0
            last = ch.items[-1] if ch.items else None
            if last is not None and last[0] + len(last[1]) == seq:
                last[1].append(event)
            else:  # the first, or the first after a gap
                ch.items.append((seq, [event]))
                if len(ch.items) == 1:
                    ch.loop.call_soon_threadsafe(ch.ready.set)
            self.pending += 1

    async def take(self) -> list[tuple[int, list[KVEvent]]]:
        ch = self.channel
        await ch.ready.wait()
        with ch.lock:
            items, ch.items, self.pending = ch.items, [], 0
            ch.ready.clear()
        return items


class EngineActor:
    """One engine per GPU (or per group of CPUs). Created by the cluster with ray.remote options."""

    def __init__(self, engine_config: dict, engine_id: int = 0, dp: dict | None = None,
                 prefill_peers: dict | None = None, tp: dict | None = None) -> None:
        """dp: attention-DP membership (rank, size, coordinator, stall_timeout_s). prefill_peers:
        a decode engine's prefill engines, {"names": [actor names], "namespace": ...}. tp: with
        tp_size > 1, the other ranks' resources and bundles (actors.tp_worker.TPGang): this actor
        is rank 0 and creates them."""
        log_to_stderr()
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex  # tells a restarted actor from the one it replaced
        self.dp: DPMember | None = None  # attention-DP: this engine's membership of its group
        shard = (dp["rank"], dp["size"]) if dp else (0, 1)
        config = EngineConfig.from_kwargs(**engine_config)
        self.role = config.disaggregation_mode
        self.kv_source: RayPrefillSource | None = None  # a decode engine's way to its prefill engines
        if self.role == "decode":
            peers = prefill_peers or {}
            self.kv_source = RayPrefillSource(config.disaggregation_transfer_backend,
                                              peers.get("namespace", "radixray"), peers.get("names", []),
                                              timeout_s=config.disaggregation_transfer_timeout_s)
        self.tp_gang: TPGang | None = None
        if config.tp_size > 1:
            self.tp_gang = TPGang(config, tp, ray.get_runtime_context().get_actor_name() or "")
            self.engine = self.tp_gang.start(mlp_shard=shard, kv_source=self.kv_source)
        else:
            self.engine = Engine(config, mlp_shard=shard, kv_source=self.kv_source)
        self._kv_links: PrefillLinks | None = None  # a prefill engine's p2p links (on first use)
        # Loaded at run time: name -> (folder, pinned, load id); the load ids unloaded here (the
        # latest UNLOADED_LORAS_KEPT, oldest first); the lock orders a load's check and record.
        self._runtime_loras: dict[str, tuple[str, bool, str]] = {}
        self._unloaded_loras: dict[str, None] = {}
        self._lora_lock = threading.Lock()
        # Evicted radix paths, for the routers' cache-aware trees (each reads them by heartbeat()).
        self._evicted = EvictionLog()
        self.engine.scheduler.cache.subscribe(self._on_kv_event, MEDIUMS)
        # Multiplexed output channels (see outputs()), one per consumer (a front end): the
        # deltas of every request it submitted, drained per yield.
        self._outboxes: dict[str, _Channel] = {}
        self._consumer_of: dict[str, str] = {}  # rid -> consumer, while the request runs
        self._unstreamed: set[str] = set()  # rids without a token yet (a drain may re-route them)
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # The KV event streams (kv_events()): numbered from 1 per actor instance, buffered per
        # consumer once it reads. Engine thread appends; the actor's loop drains.
        self._kv_seq = 0
        self._kv_streams: dict[str, _KVStream] = {}
        self._kv_drop = 0  # fault injection (tests): lose this many events
        self._prefill_faults: list[str] = []  # fault injection (tests): see debug_fail_prefills
        self._kv_lock = threading.Lock()
        if dp:
            self.dp = DPMember(self.engine, die=self._die, **dp)
            self.dp.start()
        else:
            self.engine.on_fatal = self._die  # a dead loop takes the actor down: Ray restarts it
            self.engine.start_loop()
        if self.tp_gang is not None:  # a lost rank takes the engine down too (and so the gang)
            self.tp_gang.watch(self.engine, self._die)

    def leave_epoch(self, epoch: tuple[str, int]) -> None:
        """The coordinator abandoned `epoch` (a member restarted): a member of it restarts and
        rejoins. Conditional, unlike ray.kill: a late call cannot take down a member that has
        already joined the new epoch."""
        if self.dp is not None:
            self.dp.leave_epoch(epoch)

    def _die(self, error: BaseException) -> None:
        # An engine loop (or a broken collective) cannot be resumed: exit so Ray restarts us;
        # under attention-DP our rejoin makes the coordinator restart the whole group.
        print(f"radixray: engine {self.engine_id} failed ({type(error).__name__}: {error}); "
              "exiting so that Ray restarts it", file=sys.stderr, flush=True)
        os._exit(1)

    def signal_wave(self, wave: int) -> None:
        if self.dp is not None:
            self.dp.signal_wave(wave)

    def info(self) -> EngineInfo:
        mr = self.engine.model_runner
        params = mr.model.num_parameters()
        return EngineInfo(engine_id=self.engine_id, vocab_size=self.engine.model_config.vocab_size,
                          max_context_len=mr.max_context_len, max_total_tokens=mr.max_total_tokens,
                          device=str(mr.device), node_id=ray.get_runtime_context().get_node_id(),
                          pid=os.getpid(), num_parameters=params, weight_bytes=params * mr.dtype.itemsize,
                          actor_name=ray.get_runtime_context().get_actor_name() or "",
                          disaggregation_mode=self.role)

    async def generate(self, payload: bytes):
        """Streams msgpack-encoded StreamDeltas; the first token is sent as soon as it exists."""
        req = decode_request(payload)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        finished = False
        try:
            self.engine.submit(req.input_ids, req.sampling_params,
                               lambda d: loop.call_soon_threadsafe(queue.put_nowait, d), rid=req.rid,
                               priority=req.priority, lora_name=req.lora_name)
        except InvalidRequestError as e:
            finished = True
            yield encode(_invalid(req.rid, len(req.input_ids), e))
            return
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield encode(delta)
        finally:
            if not finished:  # the caller went away (cancelled, disconnected): free its KV
                self.engine.abort(req.rid, "caller went away")

    def _on_kv_event(self, event: KVEvent) -> None:
        """Engine thread, under the step lock (so kv_snapshot() sees a consistent seq)."""
        if event.kind == "removed" and event.medium == "device":  # (an adapter's paths behind its root)
            self._evicted.append(adapter_path(event.token_ids[:event.start + 1], event.lora_name))
        with self._kv_lock:
            self._kv_seq += 1
            if not self._kv_streams:
                return
            if self._kv_drop:
                self._kv_drop -= 1
                return
            for stream in self._kv_streams.values():
                stream.add(self._kv_seq, event)

    async def kv_events(self, consumer: str = ""):
        """The engine's KV events (what its prefix cache stores and evicts, and the prompt of
        each request it queues and ends), numbered, batched: one KVEventBatch per wake-up. A
        reader resyncs with kv_snapshot() after any gap."""
        self._loop = self._loop or asyncio.get_running_loop()
        with self._kv_lock:
            stream = self._kv_streams[consumer] = _KVStream(_Channel(self._loop))
        try:
            while True:
                for first, events in await stream.take():
                    yield encode(KVEventBatch(self.incarnation, first, events))
        finally:
            with self._kv_lock:
                if self._kv_streams.get(consumer) is stream:
                    del self._kv_streams[consumer]

    def kv_snapshot(self) -> bytes:
        """Everything the cache holds now, the prompts of the requests here, and the seq of the
        last event they reflect."""
        with self.engine.between_steps():  # no step mutates the tree meanwhile
            with self._kv_lock:
                seq = self._kv_seq
            cache = self.engine.scheduler.cache
            return encode(KVSnapshot(self.incarnation, seq, cache.snapshot(), self.engine.queued_prompts(),
                                     cache.snapshot("host")))

    # ---- LoRA adapters ----------------------------------------------------------------------
    def _lora_adapters(self) -> LoRAAdapters:
        """Read between steps (the step thread owns the adapter manager)."""
        lora = self.engine.lora
        if lora is None:
            return LoRAAdapters()
        with self.engine.between_steps():
            names = lora.names()
            # (a copy taken at once: loads and unloads change the dict on other threads)
            runtime = [(n, *entry) for n, entry in list(self._runtime_loras.items()) if n in names]
            return LoRAAdapters(names, lora.resident(), lora.max_loaded_loras, runtime, list(self._unloaded_loras))

    async def lora_adapters(self) -> bytes:
        """The adapters requests may name here, and those in host memory (a LoRAAdapters)."""
        return encode(await asyncio.to_thread(self._lora_adapters))

    def _lora_update(self, op: str, name: str, path: str = "", pinned: bool = False,
                     load_id: str = "") -> LoRAUpdate:
        try:
            if op == "load":
                load_id = load_id or uuid.uuid4().hex
                with self._lora_lock:
                    if load_id in self._unloaded_loras:  # a restore of a load unloaded here since
                        return LoRAUpdate(self._lora_adapters(), error=f"LoRA adapter {name!r}: this load was unloaded")
                    entry = self._runtime_loras.get(name)
                    if entry is not None and entry[2] == load_id:  # this very load (a user's call and
                        return LoRAUpdate(self._lora_adapters())  # a joining engine's sync), done or under way
                    # Recorded first, so no report lists the adapter without its folder (a report
                    # lists only served names); forgotten again if the load fails.
                    self._runtime_loras.setdefault(name, (path, pinned, load_id))
                try:
                    self.engine.load_lora_adapter(name, path, pinned)
                except BaseException:
                    with self._lora_lock:
                        if self._runtime_loras.get(name, ("", False, ""))[2] == load_id:
                            self._runtime_loras.pop(name)
                    raise
                return LoRAUpdate(self._lora_adapters())
            gone = self.engine.unload_lora_adapter(name)
            with self._lora_lock:
                entry = self._runtime_loras.pop(name, None)
                if entry is not None:
                    self._unloaded_loras[entry[2]] = None
                    while len(self._unloaded_loras) > UNLOADED_LORAS_KEPT:
                        del self._unloaded_loras[next(iter(self._unloaded_loras))]
        except UnknownLoRAError as e:
            return LoRAUpdate(self._lora_adapters(), error=str(e), unknown=True)
        except LoRAAdapterError as e:  # the engine is unchanged
            return LoRAUpdate(self._lora_adapters(), error=str(e))
        return LoRAUpdate(self._lora_adapters(), draining=not gone)

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False, load_id: str = "") -> bytes:
        """Load the PEFT adapter in folder `path` as `name` (a LoRAUpdate; a bad adapter is an
        error in it). `load_id`: the fleet-wide id of this load (the front end's; a new one if
        empty), refused if it was unloaded here. The files are read off the actor's event loop."""
        return encode(await asyncio.to_thread(self._lora_update, "load", name, path, pinned, load_id))

    async def unload_lora_adapter(self, name: str) -> bytes:
        """Unload adapter `name` (a LoRAUpdate): new requests naming it are refused; running ones
        finish with it (`draining`)."""
        return encode(await asyncio.to_thread(self._lora_update, "unload", name))

    def debug_fail_prefills(self, faults: list[str]) -> None:
        """Fault injection for tests: the next prefill_kv calls, one fault each: "exit" (this
        actor dies) or "stall" (the call never answers)."""
        self._prefill_faults.extend(faults)

    def debug_drop_kv_events(self, n: int) -> None:
        """Fault injection for tests: the next n KV events are lost (the reader sees a gap)."""
        with self._kv_lock:
            self._kv_drop += n

    def _outbox(self, consumer: str) -> _Channel:
        box = self._outboxes.get(consumer)
        if box is None:
            box = self._outboxes[consumer] = _Channel(self._loop)
        return box

    def _sink(self, consumer: str):
        """The engine-thread sink of one consumer's requests."""
        box = self._outbox(consumer)

        def sink(delta: StreamDelta) -> None:
            if delta.token_ids:
                self._unstreamed.discard(delta.rid)
            if delta.finish_reason is not None:
                self._unstreamed.discard(delta.rid)
                self._consumer_of.pop(delta.rid, None)
            box.put(delta)
        return sink

    async def submit(self, payload: bytes, consumer: str = "") -> str:
        """Queue a request whose deltas go to `consumer`'s outputs() channel (the cluster's
        path). Returns this actor instance's incarnation."""
        self._loop = self._loop or asyncio.get_running_loop()
        req = decode_request(payload)
        sink = self._sink(consumer)
        if self._draining:  # never taken: the front end sends it elsewhere
            sink(_refused(req.rid, len(req.input_ids)))
            return self.incarnation
        self._consumer_of[req.rid] = consumer
        self._unstreamed.add(req.rid)
        if self.kv_source is not None and req.prefill_engine:
            self.kv_source.hint(req.rid, req.prefill_engine)
        try:
            self.engine.submit(req.input_ids, req.sampling_params, sink, rid=req.rid, priority=req.priority,
                               lora_name=req.lora_name)
        except InvalidRequestError as e:
            sink(_invalid(req.rid, len(req.input_ids), e))
        return self.incarnation

    def set_prefill_peers(self, names: list[str]) -> None:
        """A decode engine's prefill engines (actor names), when the fleet changes."""
        if self.kv_source is not None:
            self.kv_source.set_peers(names)

    async def prefill_kv(self, fetch: bytes, kv_rid: str, link: bytes | None = None,
                         tag: int = -1) -> tuple[bytes, Any]:
        """A prefill engine's side of one KV transfer (a decode engine's RayPrefillSource calls
        it): compute the prompt, sample its first token, and return the KV of the tokens the
        decode engine lacks, with what it needs to go on. link: the decode engine's p2p link
        address; the KV then goes over it (tagged `tag`) and the result carries the metadata
        only. Cancelled (the decode side gave up): the request is aborted and its KV freed."""
        request = msgspec.msgpack.decode(fetch, type=KVFetch)
        if self._prefill_faults:
            fault = self._prefill_faults.pop(0)
            if fault == "exit":
                self._die(RuntimeError("injected fault: the prefill engine dies"))
            await asyncio.Event().wait()  # "stall": never answers (until the decode side cancels)
        kv_link = None
        if link is not None:  # joined before the prefill: the decode side waits for us meanwhile
            if self._kv_links is None:
                self._kv_links = PrefillLinks(self.engine.config.disaggregation_transfer_timeout_s)
            address = msgspec.msgpack.decode(link, type=LinkAddress)
            kv_link = await asyncio.to_thread(self._kv_links.join, address)
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        channel = LocalKVChannel()
        channel.bootstrap(request.skip)  # the fetch says how much the decode side holds
        channel.on_change(lambda: loop.call_soon_threadsafe(ended.set))
        submit_prefill(self.engine, request, channel, kv_rid)
        try:
            await ended.wait()
        finally:
            if channel.poll() != KVPoll.Success:
                channel.fail("the decode engine gave up")  # (the prefill, if still queued, sees it)
                self.engine.abort(kv_rid, "the decode engine gave up")
        if channel.poll() != KVPoll.Success:
            raise RuntimeError(channel.failure() or "the prefill failed")
        payload = channel.take()
        if kv_link is None:
            return payload_to_wire(payload)
        # The send completes once the decode side receives, which it does after this returns.
        threading.Thread(target=self._send_kv, args=(kv_link, kv_bytes(payload.kv), tag, address),
                         name="radixray-kv-send", daemon=True).start()
        return payload_meta(payload), None

    def _send_kv(self, link: KVLink, data: Any, tag: int, address: LinkAddress) -> None:
        try:
            link.send(data, tag)
        except Exception as e:  # the decode engine went away: a new link next time
            print(f"radixray: KV send to {address.link_id} failed ({type(e).__name__}: {e})", file=sys.stderr,
                  flush=True)
            self._kv_links.drop(address)

    def incarnation_id(self) -> str:
        return self.incarnation

    async def outputs(self, consumer: str = ""):
        """One long-lived stream carrying every request `consumer` submitted, batched: one Ray
        object per engine step or so, instead of one per token per request. When the stream
        ends (the consumer went away), its requests are aborted: nobody reads them any more."""
        self._loop = self._loop or asyncio.get_running_loop()
        box = self._outbox(consumer)
        try:
            while True:
                batch = await box.take()
                if batch:
                    yield encode_batch(batch)
        finally:
            if self._outboxes.get(consumer) is box:  # a departed front end leaves nothing behind
                del self._outboxes[consumer]
            for rid, owner in list(self._consumer_of.items()):
                if owner == consumer:
                    self.engine.abort(rid, "its front end went away")

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    async def drain(self, reroute_after_s: float, timeout_s: float) -> int:
        """Leave the fleet gracefully: take no new request, let the running ones finish; after
        reroute_after_s, hand back those without a token yet (their front end re-routes them,
        error kind "draining"). Returns how many requests were still running at timeout_s."""
        self._draining = True
        start = time.monotonic()
        rerouted = False
        # Until every request has ended and its last deltas have left for its front end.
        while (self.engine.has_pending() or self._consumer_of
               or any(box.items for box in self._outboxes.values())):
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                return len(self._consumer_of)
            if not rerouted and elapsed > reroute_after_s:
                rerouted = True
                for rid in list(self._unstreamed):
                    self.engine.abort(rid, "engine is draining", kind="draining")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the outputs() streams hand their last batch to Ray
        return 0

    def stats(self) -> EngineActorStats:
        dp = None
        if self.dp is not None and self.dp.loop is not None:
            loop = self.dp.loop
            dp = DPMemberStats(rank=loop.comm.rank, waves=loop.waves, steps=loop.steps,
                               collective_seconds=loop.comm.collective_seconds,
                               collective_bytes=loop.comm.collective_bytes, wave_requests=loop.wave_requests,
                               stalled_s=self.dp.stalled_for())
        return EngineActorStats(engine_id=self.engine_id, healthy=self.engine.dead is None,
                                engine=self.engine.stats(), dp=dp, role=self.role)

    def debug_tp_workers(self) -> list:
        """The other ranks' actors (tests kill one)."""
        return list(self.tp_gang.workers) if self.tp_gang is not None else []

    def ready(self) -> bool:
        """For waiters: False while the engine's DP group forms (expected: not an error);
        raises when check_health would for any other reason."""
        if self.dp is not None and self.dp.loop is None and self.engine.dead is None:
            return False
        return self.check_health()

    def check_health(self) -> bool:
        if self.dp is not None:
            self.dp.check()  # still joining its group, or stalled
        if self.engine.dead is not None:
            raise RuntimeError(f"engine {self.engine_id} is dead: {self.engine.dead}")
        return True

    def heartbeat(self, after: int = -1, incarnation: str = "") -> bytes:
        """Health check that also hands over the radix paths evicted after the caller's cursor
        `after` (the seq of its last Evictions from this `incarnation`). A caller without one
        (after < 0, or another instance's) gets none: only the cursor to start from."""
        self.check_health()
        if after < 0 or incarnation != self.incarnation:
            return encode(Evictions(self.incarnation, self._evicted.seq, []))
        seq, paths, lost = self._evicted.after(after)
        return encode(Evictions(self.incarnation, seq, paths, lost))

    async def check_memory(self, timeout_s: float = 60.0) -> EngineStats:
        """Wait until the engine is idle, then check its memory invariant (raises if broken).
        Async: a blocking wait would hold the actor's event loop and starve abort() calls."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_pending():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id} still busy after {timeout_s}s")
            await asyncio.sleep(0.02)
        self.engine.check_memory()
        return self.engine.stats()
