"""EngineActor: a Ray actor hosting one Engine whose loop runs on a background thread."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque

import ray

from actors.protocol import EngineInfo, decode_request, encode
from engine import Engine, EngineConfig, InvalidRequestError, StreamDelta

MAX_PENDING_EVICTIONS = 4096


class EngineActor:
    """One engine per GPU (or per group of CPUs). Created by the cluster with ray.remote options."""

    def __init__(self, engine_config: dict, engine_id: int = 0) -> None:
        self.engine_id = engine_id
        self.engine = Engine(EngineConfig.from_kwargs(**engine_config))
        # Evicted radix paths, for the router's cache-aware tree (drained by heartbeat()).
        self._evicted: deque[list[int]] = deque(maxlen=MAX_PENDING_EVICTIONS)
        self.engine.scheduler.tree_cache.on_evict.append(self._evicted.append)
        self.engine.start_loop()

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

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def stats(self) -> dict:
        return {**self.engine.stats(), "engine_id": self.engine_id, "healthy": self.engine.dead is None}

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
