"""DllmRunner: the block-diffusion side of the scheduler. It admits requests (prefix match at
block granularity, the first block), turns each DLLM_EXTEND forward's logits into unmasked
positions and committed blocks, and ends requests (a finished one's final blocks go to the radix
cache). The batch itself is built by `ScheduleBatch.prepare_for_dllm_extend` and
`ForwardBatch.init_new`, run by the model runner; each request's block is `Req.dllm_block`.

Each forward is an extend per request from its `DllmBlock.prefix_len` to the end of its block:
the block being denoised, preceded, right after a commit, by the committed block (whose KV is
recomputed with its final tokens) or, for a new request, by the prompt after its cached prefix.
Block-causal attention makes the recomputation exact, so no forward is spent on a committed
block alone.

Prefix caching is at block granularity: the KV of a position depends on the tokens up to the
end of its block, so only whole blocks are taken from the radix cache or given to it, and a
request whose tokens leave the cached path inside a block adds nothing to it (the radix tree
compares single tokens; a path split inside a block would pair one request's KV with another's
tokens)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.cache_manager import CacheManager
from engine.dllm.algorithm import DllmAlgorithm
from engine.dllm.block import DllmBlock, commit
from engine.dllm.config import DllmConfig
from engine.req import Req

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class DllmLogits:
    """A DLLM_EXTEND forward's logits, handed to the scheduler the way sampled ids are
    (`resolve()`): the unmasking runs when the scheduler processes the batch."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def resolve(self) -> torch.Tensor:
        return self.logits


class DllmRunner:
    def __init__(
        self,
        cache: CacheManager,
        config: DllmConfig,
        algorithm: DllmAlgorithm,
        eos_token_ids: frozenset[int],
        max_context_len: int,
        decode_tail: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.cache = cache
        self.config = config
        self.algorithm = algorithm
        self.eos_token_ids = eos_token_ids
        self.decode_tail = decode_tail
        self.max_context_len = max_context_len
        self.live: set[str] = (
            set()
        )  # rids of admitted requests that have not ended (or been retracted)
        # Stats (the bench's tokens per forward): DLLM_EXTEND forwards, (request, forward) pairs,
        # positions unmasked, output tokens committed (after truncation at max_new_tokens, EOS or a stop).
        self.forwards = 0
        self.request_forwards = 0
        self.unmasked_tokens = 0
        self.committed_tokens = 0

    # ---- admission ---------------------------------------------------------------------------
    def match_prefix(self, req: Req) -> None:
        """Match the cached prefix, whole blocks only, and set `extend_input_len` to what its
        first forward computes (from the prefix to its block's end): the admission budget."""
        bs = self.config.block_size
        self.cache.match_prefix(req)
        req.prefix_indices = req.prefix_indices[: len(req.prefix_indices) // bs * bs]
        block = req.dllm_block
        end = (
            block.end
            if block is not None
            else min(len(req.fill_ids) // bs * bs + bs, self.max_context_len)
        )
        req.extend_input_len = end - len(req.prefix_indices)

    def start(self, req: Req) -> None:
        """The request was admitted (its prefix locked): its first block, or, for a retracted
        request, its block as it was (its unmasked positions stand), computed from the new prefix."""
        if req.dllm_block is None:
            req.dllm_block = DllmBlock.first(
                req.fill_ids,
                len(req.prefix_indices),
                self.config.block_size,
                self.config.mask_token_id,
                self.max_context_len,
            )
        else:
            req.dllm_block.prefix_len = len(req.prefix_indices)
        self.live.add(req.rid)

    def admit(self, req: Req) -> None:
        """Match, lock and start (outside the scheduler, which admits through its PrefillAdder)."""
        self.match_prefix(req)
        self.cache.lock(req)
        self.start(req)

    def slots_needed(self, reqs: list[Req]) -> int:
        """KV slots the next DLLM_EXTEND needs for these admitted requests with a row (a block
        just begun; their other positions hold slots already)."""
        return sum(
            r.dllm_block.end - r.kv_len
            for r in reqs
            if r.req_pool_idx is not None and r.kv_len < r.dllm_block.end
        )

    # ---- after a forward ---------------------------------------------------------------------
    def unmask(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """The algorithm's step on every request's block (`logits`: the masked positions' rows,
        block by block)."""
        self.unmasked_tokens += sum(
            self.algorithm.unmask(logits, [r.dllm_block for r in reqs], reqs)
        )
        self.forwards += 1
        self.request_forwards += len(reqs)

    def settle(self, req: Req) -> list[int]:
        """After `unmask`: the request's KV is final up to its block's start; a block with no mask
        left commits (its tokens join the output, with the stop checks). Returns the tokens
        committed; then `next_block` (the caller keeps the cache call apart from these checks)."""
        block = req.dllm_block
        block.prefix_len = block.start
        if not req.output_ids and block.prefix_len > req.cache_protected_len:
            self._cache_prompt(req)  # requests sharing the prompt hit it at once
        if block.masked():
            return []
        appended = commit(req, block, self.eos_token_ids, self.max_context_len, self.decode_tail)
        self.committed_tokens += len(appended)
        return appended

    def next_block(self, req: Req) -> None:
        """After a commit: the next block begins, or the request ended (`finish`)."""
        if req.finished():
            self.finish(req)
        else:
            req.dllm_block.advance(self.config.block_size, self.max_context_len)

    def process(self, reqs: list[Req], logits: torch.Tensor) -> list[Req]:
        """`unmask`, then `settle` each request; returns those whose block committed."""
        self.unmask(reqs, logits)
        committed = []
        for req in reqs:
            if self.settle(req):
                self.next_block(req)
                committed.append(req)
        return committed

    def _cache_prompt(self, req: Req) -> None:
        """Give the radix cache the prompt's whole blocks whose KV is final (up to the block's
        start), unless the request leaves the cached path inside a block."""
        tree, prefix = self.cache.tree, req.dllm_block.prefix_len
        if not tree.shares_prefixes:
            return
        cached, _ = tree.match_prefix(req.fill_ids[:prefix])
        if len(cached) % self.config.block_size:
            return
        # cache_unfinished_req caches the KV up to kv_len: for the call, only what is final.
        kv_len, req.kv_len = req.kv_len, prefix
        try:
            self.cache.cache_unfinished_req(req)
        finally:
            req.kv_len = kv_len

    # ---- standalone (outside the scheduler) ------------------------------------------------------
    def step(self, model_runner: ModelRunner, reqs: list[Req]) -> list[Req]:
        """One DLLM_EXTEND forward for these admitted requests; returns those whose block committed."""
        from engine.forward_batch import ForwardBatch
        from engine.schedule_batch import ScheduleBatch

        batch = ScheduleBatch(reqs, self.cache, model_runner.device)
        batch.prepare_for_dllm_extend()
        return self.process(
            reqs, model_runner.forward(ForwardBatch.init_new(batch, model_runner.device))
        )

    def generate(self, model_runner: ModelRunner, reqs: list[Req]) -> None:
        """Admit the requests and run DLLM_EXTEND batches of all unfinished ones to the end."""
        for req in reqs:
            self.admit(req)
        running = list(reqs)
        while running:
            self.step(model_runner, running)
            running = [r for r in running if not r.finished()]

    # ---- a request's KV at its end ---------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """The request ended (or is aborted): the KV of its final blocks (before its block's
        prefix_len) goes to the cache, the rest of its slots and its row are freed."""
        self._drop_kv(req)
        req.dllm_block = None

    def retract(self, req: Req) -> None:
        """Out of KV: as `finish`, but the request keeps its block (positions unmasked so far stand)
        and is admitted again later, recomputing its KV from the cache's whole blocks on."""
        self._drop_kv(req)

    def _drop_kv(self, req: Req) -> None:
        self.live.discard(req.rid)
        block = req.dllm_block
        if req.req_pool_idx is None:  # admitted, never prepared: only the lock to give back
            if req.last_node is not None:
                self.cache.unlock(req)
            req.release_kv_state()
            return
        # Past prefix_len the KV saw masks, or is a committed block's awaiting its recomputation.
        self.cache.truncate(req, block.prefix_len if block is not None else req.cache_protected_len)
        tree = self.cache.tree
        if tree.shares_prefixes:
            cached, _ = tree.match_prefix(req.fill_ids[: req.kv_len])
            if len(cached) % self.config.block_size:  # leaving the cached path inside a block
                self.cache.truncate(req, req.cache_protected_len)
        self.cache.cache_finished_req(req)

    def release(self, req: Req) -> None:
        """End a failed request without caching anything it computed."""
        self.live.discard(req.rid)
        req.dllm_block = None
        self.cache.release_req(req)

    def check_idle(self) -> None:
        """No admitted request is left, and the cache's idle invariant holds."""
        if self.live:
            raise RuntimeError(
                f"{len(self.live)} DLLM requests left admitted with no request running"
            )
        self.cache.check_idle()
