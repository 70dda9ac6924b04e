"""EngineActor: a Ray actor hosting one Engine whose loop runs on a background thread."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque

import ray

from actors.protocol import (
    EngineInfo,
    KVEventBatch,
    KVSnapshot,
    decode_request,
    encode,
    encode_batch,
)
from actors.stats import DPMemberStats, EngineActorStats
from engine import Engine, EngineConfig, InvalidRequestError, StreamDelta
from engine.cache_manager import KVEvent
from engine.engine import EngineStats
from engine.logs import log_to_stderr

MAX_PENDING_EVICTIONS = 4096
# KV events buffered for the kv_events() stream; past this the consumer is too slow: the buffer
# is dropped and the consumer, seeing a gap in the sequence, resyncs from a snapshot.
MAX_PENDING_KV_EVENTS = 65536


def _invalid(rid: str, prompt_tokens: int, error: InvalidRequestError) -> StreamDelta:
    return StreamDelta(rid=rid, text="", token_ids=[], finish_reason="abort", prompt_tokens=prompt_tokens,
                       error=f"invalid request: {error}", error_kind="invalid_request")


class EngineActor:
    """One engine per GPU (or per group of CPUs). Created by the cluster with ray.remote options."""

    def __init__(self, engine_config: dict, engine_id: int = 0, dp: dict | None = None) -> None:
        log_to_stderr()
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex  # tells a restarted actor from the one it replaced
        self.dp_loop = None
        shard = (dp["rank"], dp["size"]) if dp else (0, 1)
        self.engine = Engine(EngineConfig.from_kwargs(**engine_config), mlp_shard=shard)
        # Evicted radix paths, for the router's cache-aware tree (drained by heartbeat()).
        self._evicted: deque[list[int]] = deque(maxlen=MAX_PENDING_EVICTIONS)
        self.engine.scheduler.cache.subscribe(self._on_kv_event)
        # Multiplexed output channel (see outputs()): deltas of every request, drained per yield.
        self._outbox: list[StreamDelta] = []
        self._outbox_lock = threading.Lock()
        self._outbox_ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # The KV event stream (kv_events()): numbered from 1 per actor instance, buffered only
        # once someone reads it. Engine thread appends; the actor's loop drains.
        self._kv_seq = 0
        self._kv_batches: list[tuple[int, list[KVEvent]]] = []  # (first seq, consecutive events)
        self._kv_pending = 0
        self._kv_streaming = False
        self._kv_drop = 0  # fault injection (tests): lose this many events
        self._kv_lock = threading.Lock()
        self._kv_ready = asyncio.Event()
        # Attention-DP: the epoch this member joined, and the oldest epoch it may still serve.
        self._in_dp_group = dp is not None
        self._dp_epoch: int | None = None
        self._dp_min_epoch = 0
        if dp:
            # Rendezvous on a thread: the constructor returns, so the coordinator's
            # leave_epochs_before() reaches a member even while it waits for its peers.
            threading.Thread(target=self._start_dp, kwargs=dp, name="radixray-dp-join", daemon=True).start()
        else:
            self.engine.on_fatal = self._die  # a dead loop takes the actor down: Ray restarts it
            self.engine.start_loop()

    def _start_dp(self, rank: int, size: int, coordinator, timeout_s: float = 30.0) -> None:
        """Join the group (rendezvous through the coordinator) and run the lock-step loop."""
        from engine.dp import DPComm, DPLoop

        try:
            epoch = ray.get(coordinator.join.remote(rank, ray.get_runtime_context().current_actor))
            self._dp_epoch = epoch
            if epoch < self._dp_min_epoch:  # the group moved on while we joined
                raise RuntimeError(f"joined epoch {epoch}, but the group is at {self._dp_min_epoch}")
            if rank == 0:
                host = ray.util.get_node_ip_address()
                with socket.socket() as s:
                    s.bind(("", 0))
                    port = s.getsockname()[1]
                ray.get(coordinator.set_master.remote(epoch, host, port))
            else:
                host, port = ray.get(coordinator.get_master.remote(epoch))
            comm = DPComm(host, port, rank, size, self.engine.model_runner.device, timeout_s)
            self.dp_loop = DPLoop(self.engine, comm, lambda: coordinator.request_wave.remote(), self._die)
            self.engine.on_work = self.dp_loop.wake
            self.dp_loop.start()
        except BaseException as e:  # a peer vanished mid-rendezvous, an abandoned epoch: start over
            self._die(e)

    def leave_epochs_before(self, epoch: int) -> None:
        """The coordinator started `epoch` (a member restarted): a member of an older epoch
        restarts and rejoins. Conditional, unlike ray.kill: a late call cannot take down a
        member that has already joined the new epoch."""
        self._dp_min_epoch = max(self._dp_min_epoch, epoch)
        if self._dp_epoch is not None and self._dp_epoch < epoch:
            self._die(RuntimeError(f"DP epoch {self._dp_epoch} was replaced by {epoch}"))

    def _die(self, error: BaseException) -> None:
        # An engine loop (or a broken collective) cannot be resumed: exit so Ray restarts us;
        # under attention-DP our rejoin makes the coordinator restart the whole group.
        print(f"radixray: engine {self.engine_id} failed ({type(error).__name__}: {error}); "
              "exiting so that Ray restarts it", file=sys.stderr, flush=True)
        os._exit(1)

    def signal_wave(self, wave: int) -> None:
        if self.dp_loop is not None:
            self.dp_loop.signal(wave)

    def info(self) -> EngineInfo:
        mr = self.engine.model_runner
        params = mr.model.num_parameters()
        return EngineInfo(engine_id=self.engine_id, vocab_size=self.engine.model_config.vocab_size,
                          max_context_len=mr.max_context_len, max_total_tokens=mr.max_total_tokens,
                          device=str(mr.device), node_id=ray.get_runtime_context().get_node_id(),
                          pid=os.getpid(), num_parameters=params, weight_bytes=params * mr.dtype.itemsize)

    async def generate(self, payload: bytes):
        """Streams msgpack-encoded StreamDeltas; the first token is sent as soon as it exists."""
        req = decode_request(payload)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        finished = False
        try:
            self.engine.submit(req.input_ids, req.sampling_params,
                               lambda d: loop.call_soon_threadsafe(queue.put_nowait, d), rid=req.rid)
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
        if event.kind == "removed":
            self._evicted.append(event.token_ids)
        with self._kv_lock:
            self._kv_seq += 1
            if not self._kv_streaming:
                return
            if self._kv_drop:
                self._kv_drop -= 1
                return
            if self._kv_pending >= MAX_PENDING_KV_EVENTS:
                self._kv_batches, self._kv_pending = [], 0
            if not self._kv_batches:
                self._loop.call_soon_threadsafe(self._kv_ready.set)
            last = self._kv_batches[-1] if self._kv_batches else None
            if last is not None and last[0] + len(last[1]) == self._kv_seq:
                last[1].append(event)
            else:  # the first, or the first after a gap
                self._kv_batches.append((self._kv_seq, [event]))
            self._kv_pending += 1

    async def kv_events(self):
        """The engine's KV events (what its prefix cache stores and evicts), numbered, batched:
        one KVEventBatch per wake-up. A reader resyncs with kv_snapshot() after any gap."""
        self._loop = self._loop or asyncio.get_running_loop()
        with self._kv_lock:
            self._kv_streaming = True
        while True:
            await self._kv_ready.wait()
            with self._kv_lock:
                batches, self._kv_batches, self._kv_pending = self._kv_batches, [], 0
                self._kv_ready.clear()
            for first, events in batches:
                yield encode(KVEventBatch(self.incarnation, first, events))

    def kv_snapshot(self) -> bytes:
        """Everything the cache holds now and the seq of the last event it reflects."""
        with self.engine.between_steps():  # no step mutates the tree meanwhile
            with self._kv_lock:
                seq = self._kv_seq
            return encode(KVSnapshot(self.incarnation, seq, self.engine.scheduler.cache.snapshot()))

    def debug_drop_kv_events(self, n: int) -> None:
        """Fault injection for tests: the next n KV events are lost (the reader sees a gap)."""
        with self._kv_lock:
            self._kv_drop += n

    def _to_outbox(self, delta: StreamDelta) -> None:
        """Engine-thread sink: one wake-up per burst of deltas, not one per delta."""
        with self._outbox_lock:
            self._outbox.append(delta)
            first = len(self._outbox) == 1
        if first:
            self._loop.call_soon_threadsafe(self._outbox_ready.set)

    async def submit(self, payload: bytes) -> str:
        """Queue a request whose deltas go to the outputs() channel (the cluster's path).
        Returns this actor instance's incarnation."""
        self._loop = self._loop or asyncio.get_running_loop()
        req = decode_request(payload)
        try:
            self.engine.submit(req.input_ids, req.sampling_params, self._to_outbox, rid=req.rid)
        except InvalidRequestError as e:
            self._to_outbox(_invalid(req.rid, len(req.input_ids), e))
        return self.incarnation

    def incarnation_id(self) -> str:
        return self.incarnation

    async def outputs(self):
        """One long-lived stream carrying every submitted request's deltas, batched: one Ray
        object per engine step or so, instead of one per token per request."""
        self._loop = self._loop or asyncio.get_running_loop()
        while True:
            await self._outbox_ready.wait()
            with self._outbox_lock:
                batch, self._outbox = self._outbox, []
                self._outbox_ready.clear()
            if batch:
                yield encode_batch(batch)

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def stats(self) -> EngineActorStats:
        dp = None
        if self.dp_loop is not None:
            dp = DPMemberStats(rank=self.dp_loop.comm.rank, waves=self.dp_loop.waves, steps=self.dp_loop.steps,
                               collective_seconds=self.dp_loop.comm.collective_seconds,
                               collective_bytes=self.dp_loop.comm.collective_bytes)
        return EngineActorStats(engine_id=self.engine_id, healthy=self.engine.dead is None,
                                engine=self.engine.stats(), dp=dp)

    def check_health(self) -> bool:
        if self._in_dp_group and self.dp_loop is None:
            raise RuntimeError(f"engine {self.engine_id} is still joining its DP group")
        if self.engine.dead is not None:
            raise RuntimeError(f"engine {self.engine_id} is dead: {self.engine.dead}")
        return True

    def heartbeat(self) -> list[list[int]]:
        """Health check that also hands over the radix paths evicted since the last call."""
        self.check_health()
        out = []
        while self._evicted:  # popleft, not copy-then-clear: the engine thread appends meanwhile
            out.append(self._evicted.popleft())
        return out

    async def check_memory(self, timeout_s: float = 60.0) -> EngineStats:
        """Wait until the engine is idle, then check its memory invariant (raises if broken).
        Async: a blocking wait would hold the actor's event loop and starve abort() calls."""
        deadline = time.monotonic() + timeout_s
        while self.engine.scheduler.has_work() or not self.engine._inbox.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id} still busy after {timeout_s}s")
            await asyncio.sleep(0.02)
        self.engine.check_memory()
        return self.engine.stats()
