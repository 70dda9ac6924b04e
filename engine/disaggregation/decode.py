"""The decode role: requests wait here for KV. A request gets a `req_to_token` row and KV slots
for what this engine's own cache lacks (pre-allocation, bounded by the KV budget left after the
running batch's reserve, so transfers in flight never starve the decodes), then its KV is fetched
from a prefill engine through the `KVSource`. Received KV is written into the slots; the
scheduler then runs the request's PREBUILT batch (no forward) and it joins the decode batch."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.cache_manager import CacheManager
from engine.disaggregation.kv_pages import scatter_kv
from engine.disaggregation.transfer import KVFetch, KVPayload, KVPoll, KVSource
from engine.errors import ErrorKind
from engine.memory import KVCache
from engine.req import Req

# A request whose KV fetch fails (a prefill engine died, a transfer stalled) is fetched again
# (the source picks a live prefill engine) this many times in all before it ends with an error.
MAX_FETCH_ATTEMPTS = 3


class DecodePrealloc:
    def __init__(self, cache: CacheManager, kv_cache: KVCache, source: KVSource, timeout_s: float,
                 wake: Callable[[], None]) -> None:
        self.cache = cache
        self.kv_cache = kv_cache
        self.source = source
        self.timeout_s = timeout_s
        self.wake = wake
        self.pending: list[Req] = []  # waiting for memory to pre-allocate
        self.transferring: list[Req] = []  # pre-allocated, their KV on its way
        self.received = 0  # transfers completed
        self.received_tokens = 0
        self.received_bytes = 0
        self.skipped_tokens = 0  # tokens this engine's own cache held: not transferred
        self.transfer_seconds = 0.0
        self.wire_seconds = 0.0  # from the prefill engine's hand-over to the KV in place here

    def __len__(self) -> int:
        return len(self.pending) + len(self.transferring)

    def add(self, req: Req, first: bool = False) -> None:
        """Queue a request for KV: a new one at the back, a retracted one (first=True) in front."""
        if first:
            self.pending.insert(0, req)
        else:
            self.pending.append(req)

    def retract(self) -> int:
        """Memory for the running batch first: give back every pre-allocation whose KV has not
        arrived (each is fetched again later, not counted as a failed attempt). Returns the slots freed."""
        freed = 0
        for req in reversed(self.transferring):
            req.kv_receiver.fail("the decode engine needed the memory back")
            freed += req.kv_len - req.cache_protected_len
            self.cache.release_req(req)
            req.kv_receiver = None
            req.num_kv_fetches -= 1
            self.pending.insert(0, req)
        self.transferring = []
        return freed

    def needs_step(self) -> bool:
        """Whether step() has something to do now: requests to pre-allocate for, or transfers
        that ended (received, failed or past their deadline)."""
        now = time.monotonic()
        return bool(self.pending) or any(r.kv_receiver.poll() in (KVPoll.Success, KVPoll.Failed)
                                         or now > r.disagg[1] for r in self.transferring)

    def remove(self, req: Req, reason: str) -> bool:
        """Take out an aborted request; its pre-allocation is freed (never cached: no KV yet)."""
        if req in self.pending:
            self.pending.remove(req)
            return True
        if req in self.transferring:
            self.transferring.remove(req)
            req.kv_receiver.fail(reason)
            self.cache.release_req(req)
            return True
        return False

    def step(self, reserved: int, free_rows: int) -> tuple[list[Req], list[tuple[Req, str, ErrorKind]]]:
        """Poll transfers, then pre-allocate what the budget allows. Returns the requests whose KV
        is in place (ready for their PREBUILT batch) and those that failed for good."""
        ready, failed, still = [], [], []
        for req in self.transferring:
            state = req.kv_receiver.poll()
            deadline = req.disagg[1]
            if state == KVPoll.Success:
                try:
                    self._receive(req, req.kv_receiver.take())
                    req.kv_receiver = None  # the transfer is over (its buffers may go)
                    ready.append(req)
                    continue
                except Exception as e:
                    reason = f"the received KV does not fit: {type(e).__name__}: {e}"
            elif state == KVPoll.Failed:
                reason = req.kv_receiver.failure() or "KV transfer failed"
            elif time.monotonic() > deadline:
                reason = "KV transfer timed out"
                req.kv_receiver.fail(reason)
            else:
                still.append(req)
                continue
            self.cache.release_req(req)  # nothing was cached: the slots may hold garbage
            req.kv_receiver = None
            if req.num_kv_fetches >= MAX_FETCH_ATTEMPTS:
                failed.append((req, f"{reason} ({req.num_kv_fetches} attempts)", "kv_transfer_failed"))
            else:
                self.pending.insert(0, req)
        self.transferring = still
        while self.pending and free_rows > 0 and self._preallocate(self.pending[0], reserved):
            req = self.pending.pop(0)
            free_rows -= 1
            if req.kv_len == len(req.prefix_indices):  # this engine's cache holds all of it
                req.kv_payload = None
                ready.append(req)
                continue
            try:
                self._fetch(req)
            except Exception as e:  # no prefill engine to ask: the request ends
                self.cache.release_req(req)
                failed.append((req, f"no KV source: {type(e).__name__}: {e}", "engine_error"))
        return ready, failed

    def _tokens(self, req: Req) -> list[int]:
        """Tokens whose KV the request needs before it decodes: its prompt (the first token comes
        with the KV), or, retracted, everything but its last token (the next decode computes it)."""
        return req.fill_ids[:-1] if req.output_ids else req.origin_input_ids

    def _preallocate(self, req: Req, reserved: int) -> bool:
        """Lock the cached prefix, take a row and slots for the rest; False: not enough memory yet."""
        self.cache.match_prefix(req)
        need = len(self._tokens(req)) - len(req.prefix_indices)
        self.cache.lock(req)  # first: a prefix it locks leaves the budget
        if self.cache.available_size() - reserved < need + 1:  # +1: its first decode step's slot
            self.cache.unlock(req)
            return False
        self.cache.alloc_extend([req], [len(req.prefix_indices)], [need])  # (the slots go into its row)
        return True

    def _fetch(self, req: Req) -> None:
        skip = len(req.prefix_indices)
        req.num_kv_fetches += 1
        params = None if req.output_ids else req.sampling_params
        seed = req.generator.initial_seed() if req.generator is not None else None
        req.kv_receiver = self.source.fetch(KVFetch(req.rid, self._tokens(req), skip, params, seed))
        req.disagg = (time.monotonic(), time.monotonic() + self.timeout_s)
        req.kv_receiver.on_change(self.wake)
        req.kv_receiver.bootstrap(skip)
        self.transferring.append(req)

    def _receive(self, req: Req, payload: KVPayload) -> None:
        skip, n = len(req.prefix_indices), req.kv_len - len(req.prefix_indices)
        if payload.start != skip or payload.num_tokens != n:
            raise ValueError(f"got tokens {payload.start}:{payload.start + payload.num_tokens}, "
                             f"expected {skip}:{skip + n}")
        scatter_kv(self.kv_cache, self.cache.kv_indices(req)[skip:], payload.kv)
        req.kv_payload = payload
        self.received += 1
        self.received_tokens += n
        self.received_bytes += payload.nbytes
        self.skipped_tokens += skip
        self.transfer_seconds += time.monotonic() - req.disagg[0]
        if payload.sent_at:
            self.wire_seconds += max(0.0, time.time() - payload.sent_at)
