"""EngineActor: a Ray actor hosting one Engine whose loop runs on a background thread."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections import deque

import ray

from actors.protocol import EngineInfo, decode_request, encode, encode_batch
from engine import Engine, EngineConfig, InvalidRequestError, StreamDelta

MAX_PENDING_EVICTIONS = 4096


class EngineActor:
    """One engine per GPU (or per group of CPUs). Created by the cluster with ray.remote options."""

    def __init__(self, engine_config: dict, engine_id: int = 0, dp: dict | None = None) -> None:
        self.engine_id = engine_id
        self.dp_loop = None
        shard = (dp["rank"], dp["size"]) if dp else (0, 1)
        self.engine = Engine(EngineConfig.from_kwargs(**engine_config), mlp_shard=shard)
        # Evicted radix paths, for the router's cache-aware tree (drained by heartbeat()).
        self._evicted: deque[list[int]] = deque(maxlen=MAX_PENDING_EVICTIONS)
        self.engine.scheduler.tree_cache.on_evict.append(self._evicted.append)
        # Multiplexed output channel (see outputs()): deltas of every request, drained per yield.
        self._outbox: list[StreamDelta] = []
        self._outbox_lock = threading.Lock()
        self._outbox_ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        if dp:
            self._start_dp(**dp)
        else:
            self.engine.start_loop()

    def _start_dp(self, rank: int, size: int, coordinator, timeout_s: float = 30.0) -> None:
        """Join the group (rendezvous through the coordinator) and run the lock-step loop."""
        from engine.dp import DPComm, DPLoop

        epoch = ray.get(coordinator.join.remote(rank, ray.get_runtime_context().current_actor))
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

    @staticmethod
    def _die(error: BaseException) -> None:
        # A broken collective cannot be resumed: exit so Ray restarts us, and our rejoin
        # makes the coordinator restart the whole group.
        print(f"radixray: DP member failed ({type(error).__name__}: {error}); restarting", flush=True)
        os._exit(1)

    def signal_wave(self, wave: int) -> None:
        if self.dp_loop is not None:
            self.dp_loop.signal(wave)

    def info(self) -> EngineInfo:
        mr = self.engine.model_runner
        return EngineInfo(engine_id=self.engine_id, vocab_size=self.engine.model_config.vocab_size,
                          max_context_len=mr.max_context_len, max_total_tokens=mr.max_total_tokens,
                          device=str(mr.device), node_id=ray.get_runtime_context().get_node_id(),
                          pid=os.getpid())

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
            yield encode(StreamDelta(rid=req.rid, text="", token_ids=[], finish_reason="abort",
                                     prompt_tokens=len(req.input_ids), error=f"invalid request: {e}"))
            return
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield encode(delta)
        finally:
            if not finished:  # the caller went away (cancelled, disconnected): free its KV
                self.engine.abort(req.rid, "caller went away")

    def _to_outbox(self, delta: StreamDelta) -> None:
        """Engine-thread sink: one wake-up per burst of deltas, not one per delta."""
        with self._outbox_lock:
            self._outbox.append(delta)
            first = len(self._outbox) == 1
        if first:
            self._loop.call_soon_threadsafe(self._outbox_ready.set)

    async def submit(self, payload: bytes) -> None:
        """Queue a request whose deltas go to the outputs() channel (the cluster's path)."""
        self._loop = self._loop or asyncio.get_running_loop()
        req = decode_request(payload)
        try:
            self.engine.submit(req.input_ids, req.sampling_params, self._to_outbox, rid=req.rid)
        except InvalidRequestError as e:
            self._to_outbox(StreamDelta(rid=req.rid, text="", token_ids=[], finish_reason="abort",
                                        prompt_tokens=len(req.input_ids), error=f"invalid request: {e}"))

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

    def stats(self) -> dict:
        out = {**self.engine.stats(), "engine_id": self.engine_id, "healthy": self.engine.dead is None}
        if self.dp_loop is not None:
            out["dp"] = {"rank": self.dp_loop.comm.rank, "waves": self.dp_loop.waves, "steps": self.dp_loop.steps,
                         "collective_seconds": self.dp_loop.comm.collective_seconds}
        return out

    def check_health(self) -> bool:
        if self.engine.dead is not None:
            raise RuntimeError(f"engine {self.engine_id} is dead: {self.engine.dead}")
        return True

    def heartbeat(self) -> list[list[int]]:
        """Health check that also hands over the radix paths evicted since the last call."""
        self.check_health()
        out = list(self._evicted)
        self._evicted.clear()
        return out

    async def check_memory(self, timeout_s: float = 60.0) -> dict:
        """Wait until the engine is idle, then check its memory invariant (raises if broken).
        Async: a blocking wait would hold the actor's event loop and starve abort() calls."""
        deadline = time.monotonic() + timeout_s
        while self.engine.scheduler.has_work() or not self.engine._inbox.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id} still busy after {timeout_s}s")
            await asyncio.sleep(0.02)
        self.engine.check_memory()
        return self.engine.stats()

    def pid(self) -> int:
        return os.getpid()
