"""Prefill admission: which waiting requests join the next prefill batch, and how much of each."""

from __future__ import annotations

from enum import Enum, auto

from engine.cache_manager import CacheManager
from engine.req import Req


class AddResult(Enum):
    CONTINUE = auto()
    NO_TOKEN = auto()  # KV budget exhausted
    OTHER = auto()  # prefill token budget or chunk exhausted


class PrefillAdder:
    """Admits waiting requests under three budgets: KV slots (minus a reserve for the running
    requests' future tokens), prefill tokens per batch, and the chunk size."""

    def __init__(self, cache: CacheManager, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunk_size: int, mixed_with_decode: bool = False,
                 min_reserve: int = 0) -> None:
        """min_reserve: slots the running requests take in this very batch (a DLLM_EXTEND batch's
        blocks just begun), kept whatever the ratio says."""
        self.cache = cache
        reserve = sum((r.sampling_params.max_new_tokens - len(r.output_ids)) * new_token_ratio for r in running)
        if mixed_with_decode:
            # A MIXED batch adds a one-token extend per running request in this very batch: those
            # slots are needed now, whatever the ratio says (it can round below one slot each).
            min_reserve = max(min_reserve, len(running))
        reserve = max(reserve, float(min_reserve))
        self.rem_total_tokens = cache.available_size() - reserve
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunk_size
        self.new_token_ratio = new_token_ratio
        self.has_running = bool(running)
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def add_chunked_req(self, req: Req) -> None:
        """Continue a request whose prompt is being prefilled chunk by chunk."""
        fits = int(self.rem_total_tokens)
        req.extend_input_len = min(req.seqlen - req.kv_len, self.rem_chunk_tokens, fits)
        if req.extend_input_len <= 0:  # no room this round: decode frees or retracts first
            self.new_chunked_req = req
            return
        self.can_run.append(req)
        future = req.sampling_params.max_new_tokens - len(req.output_ids)
        self.rem_total_tokens -= req.extend_input_len + future * self.new_token_ratio
        self.rem_input_tokens -= req.extend_input_len
        self.rem_chunk_tokens -= req.extend_input_len
        if req.kv_len + req.extend_input_len < req.seqlen:
            self.new_chunked_req = req

    def add_one_req(self, req: Req) -> AddResult:
        ext = req.extend_input_len
        future = (req.sampling_params.max_new_tokens - len(req.output_ids))
        first = not self.can_run and not self.has_running
        if (ext > self.rem_input_tokens and self.can_run) or self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        # First: locking its prefix takes those slots (no longer evictable) out of the budget.
        locked = self.cache.lock(req)
        self.rem_total_tokens -= locked
        # The very first request goes in whenever its prompt fits, so progress is guaranteed.
        if min(ext, self.rem_chunk_tokens) + (0 if first else future) > self.rem_total_tokens:
            self.cache.unlock(req)
            self.rem_total_tokens += locked
            return AddResult.NO_TOKEN
        if ext > self.rem_chunk_tokens:
            req.extend_input_len = self.rem_chunk_tokens
            self.new_chunked_req = req
        self.can_run.append(req)
        self.rem_total_tokens -= req.extend_input_len + future * self.new_token_ratio
        self.rem_input_tokens -= req.extend_input_len
        self.rem_chunk_tokens -= req.extend_input_len
        return AddResult.CONTINUE if self.new_chunked_req is None else AddResult.OTHER
