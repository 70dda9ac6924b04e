"""The prefill role: a request whose prompt is computed (and first token sampled) waits here, its
KV locked in the radix cache, until its KV has reached the decode engine; then it ends, and its
prompt stays in this engine's cache for later requests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.cache_manager import CacheManager
from engine.disaggregation.kv_pages import gather_kv
from engine.disaggregation.transfer import KVFetch, KVPayload, KVPoll, KVSender
from engine.memory import KVCache
from engine.req import FinishReason, Req

if TYPE_CHECKING:
    from engine.engine import Engine, StreamDelta


def submit_prefill(engine: Engine, fetch: KVFetch, sender: KVSender, rid: str) -> None:
    """Queue a decode engine's fetch on a prefill engine: its KV goes out through `sender`,
    which fails if the prefill does (an error or an abort: the decode side fetches again)."""

    def sink(delta: StreamDelta) -> None:
        if delta.finish_reason == "abort":
            sender.fail(delta.error or "the prefill failed")

    engine.submit(fetch.token_ids, fetch.prefill_params(), sink, rid=rid, kv_sender=sender)


class PrefillTransfers:
    def __init__(self, cache: CacheManager, kv_cache: KVCache, timeout_s: float, wake: Callable[[], None]) -> None:
        self.cache = cache
        self.kv_cache = kv_cache
        self.timeout_s = timeout_s
        self.wake = wake
        self.queue: list[Req] = []
        self.sent = 0  # transfers completed
        self.sent_tokens = 0
        self.sent_bytes = 0

    def add(self, req: Req, first_token: int, first_logprob: object) -> None:
        """The request's prompt is computed: lock its KV in the tree and wait for the decode side."""
        self.cache.cache_unfinished_req(req)
        req.disagg = (first_token, first_logprob, time.monotonic() + self.timeout_s)
        req.kv_sender.on_change(self.wake)
        self.queue.append(req)

    def remove(self, req: Req) -> bool:
        if req in self.queue:
            self.queue.remove(req)
            return True
        return False

    def poll(self) -> list[Req]:
        """Send what can be sent; end the requests whose transfer ended (their KV goes to the cache)."""
        ended, waiting = [], []
        for req in self.queue:
            sender, (first_token, first_logprob, deadline) = req.kv_sender, req.disagg
            state = sender.poll()
            if state == KVPoll.WaitingForInput:
                try:
                    sender.send(self._payload(req, sender.skip(), first_token, first_logprob))
                except Exception as e:  # a bad skip or a broken backend: this transfer fails
                    sender.fail(f"sending the KV failed: {type(e).__name__}: {e}")
                state = sender.poll()
            if state == KVPoll.Success:
                req.finished_reason = FinishReason("transferred")
            elif state == KVPoll.Failed or time.monotonic() > deadline:
                if state != KVPoll.Failed:
                    sender.fail("the decode side did not take the KV in time")
                req.finished_reason = FinishReason("abort", message="KV transfer failed",
                                                   error_kind="kv_transfer_failed")
            else:
                waiting.append(req)
                continue
            self.cache.cache_finished_req(req)
            ended.append(req)
        self.queue = waiting
        return ended

    def _payload(self, req: Req, skip: int, first_token: int, first_logprob: object) -> KVPayload:
        prompt_len = len(req.origin_input_ids)
        if not 0 <= skip <= prompt_len:
            raise ValueError(f"the decode side holds {skip} of {prompt_len} prompt tokens")
        kv = gather_kv(self.kv_cache, self.cache.kv_indices(req)[skip:prompt_len])
        payload = KVPayload(start=skip, kv=kv, first_token=first_token, first_logprob=first_logprob,
                            generator_state=req.generator.get_state() if req.generator is not None else None,
                            prompt_logprobs=req.prompt_logprobs, cached_tokens=req.cached_tokens,
                            sent_at=time.time())
        self.sent += 1
        self.sent_tokens += payload.num_tokens
        self.sent_bytes += payload.nbytes
        return payload
