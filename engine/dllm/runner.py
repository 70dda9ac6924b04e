"""DllmRunner: DLLM_EXTEND batches of block-diffusion requests through the model runner, split
the way the scheduler runs a batch: admit (prefix match), prepare (KV slots and the
ForwardBatch), forward, process (unmask, commit, finish).

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

import torch

from engine.cache_manager import CacheManager
from engine.dllm.algorithm import DllmAlgorithm
from engine.dllm.block import DllmBlock, commit
from engine.dllm.config import DllmConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from engine.req import Req


class DllmRunner:
    def __init__(
        self,
        model_runner: ModelRunner,
        cache: CacheManager,
        config: DllmConfig,
        algorithm: DllmAlgorithm,
        eos_token_ids: frozenset[int],
        decode_tail: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model_runner = model_runner
        self.cache = cache
        self.config = config
        self.algorithm = algorithm
        self.eos_token_ids = eos_token_ids
        self.decode_tail = decode_tail
        self.max_context_len = model_runner.max_context_len
        # ModelConfig does not carry config.json's block_size: the model gets it here.
        model_runner.model.block_size = config.block_size
        self.blocks: dict[str, DllmBlock] = {}  # by rid: every admitted, unfinished request's block
        # Stats (the bench's tokens per forward): DLLM_EXTEND forwards, positions unmasked,
        # output tokens committed (after truncation at max_new_tokens, EOS or a stop).
        self.forwards = 0
        self.unmasked_tokens = 0
        self.committed_tokens = 0

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Match the request's cached prefix, whole blocks only, lock it, and start its first
        block. Its KV slots are allocated by `prepare`."""
        bs = self.config.block_size
        self.cache.match_prefix(req)
        req.prefix_indices = req.prefix_indices[: len(req.prefix_indices) // bs * bs]
        self.cache.lock(req)
        self.blocks[req.rid] = DllmBlock.first(
            req.fill_ids,
            len(req.prefix_indices),
            bs,
            self.config.mask_token_id,
            self.max_context_len,
        )

    # ---- one forward ---------------------------------------------------------------------------
    def prepare(self, reqs: list[Req]) -> ForwardBatch:
        """KV slots for blocks that have none yet (a request row for a new request), then the
        DLLM_EXTEND ForwardBatch: each request's tokens from its block's prefix_len to its end,
        logits at the positions still masked."""
        blocks = [self.blocks[r.rid] for r in reqs]
        for req, block in zip(reqs, blocks):
            if req.req_pool_idx is None or req.kv_len < block.end:
                start = block.prefix_len if req.req_pool_idx is None else req.kv_len
                self.cache.alloc_extend([req], [start], [block.end - start])
        device = self.model_runner.device
        rows = [r.req_pool_idx for r in reqs]
        prefix_lens = [b.prefix_len for b in blocks]
        extend_lens = [b.end - b.prefix_len for b in blocks]
        input_ids = [
            t for r, b in zip(reqs, blocks) for t in r.fill_ids[b.prefix_len : b.start] + b.tokens
        ]
        req_to_token = self.cache.req_to_token
        out_cache_loc = torch.cat(
            [req_to_token[row, b.prefix_len : b.end] for row, b in zip(rows, blocks)]
        )
        seq_lens = [b.end for b in blocks]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DLLM_EXTEND,
            batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, device=device),
            out_cache_loc=out_cache_loc.to(torch.int64),
            req_pool_indices=torch.tensor(rows, device=device),
            positions=torch.empty(0, dtype=torch.int64, device=device),
            seq_lens_cpu=seq_lens,
        )
        starts = fb.set_extend_layout(prefix_lens, extend_lens)
        # No logit shift: a masked position's own logits are its token's distribution.
        fb.last_token_indices = torch.tensor(
            [s + b.start - b.prefix_len + i for s, b in zip(starts, blocks) for i in b.masked()],
            dtype=torch.int64,
        )
        return fb

    def process(self, reqs: list[Req], logits: torch.Tensor) -> list[Req]:
        """After a forward of `prepare(reqs)`: unmask, and commit each block left with no mask
        (its tokens join the output). Finished requests' KV is cached (`finish`). Returns the
        requests whose block committed."""
        blocks = [self.blocks[r.rid] for r in reqs]
        self.unmasked_tokens += sum(self.algorithm.unmask(logits, blocks, reqs))
        self.forwards += 1
        committed = []
        for req, block in zip(reqs, blocks):
            block.prefix_len = block.start
            if block.masked():
                continue
            self.committed_tokens += len(
                commit(req, block, self.eos_token_ids, self.max_context_len, self.decode_tail)
            )
            if req.finished():
                self.finish(req)
            else:
                block.advance(self.config.block_size, self.max_context_len)
            committed.append(req)
        return committed

    def step(self, reqs: list[Req]) -> list[Req]:
        """One DLLM_EXTEND forward for these admitted requests; returns those whose block committed."""
        fb = self.prepare(reqs)
        return self.process(reqs, self.model_runner.forward(fb))

    def generate(self, reqs: list[Req]) -> None:
        """Admit the requests and run DLLM_EXTEND batches of all unfinished ones to the end."""
        for req in reqs:
            self.admit(req)
        running = list(reqs)
        while running:
            self.step(running)
            running = [r for r in running if not r.finished()]

    # ---- a request's KV at its end ---------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """The request ended (or is aborted): the KV of its final blocks (before its last block's
        start) goes to the cache, the rest of its slots and its row are freed."""
        block = self.blocks.pop(req.rid)
        if req.req_pool_idx is None:  # admitted, never prepared: only the lock to give back
            self.cache.unlock(req)
            req.release_kv_state()
            return
        # Past prefix_len the KV saw masks, or is a committed block's awaiting its recomputation.
        self.cache.truncate(req, block.prefix_len)
        tree = self.cache.tree
        if tree.shares_prefixes:
            cached, _ = tree.match_prefix(req.fill_ids[: req.kv_len])
            if len(cached) % self.config.block_size:  # leaving the cached path inside a block
                self.cache.truncate(req, req.cache_protected_len)
        self.cache.cache_finished_req(req)

    def release(self, req: Req) -> None:
        """End a failed request without caching anything it computed."""
        self.blocks.pop(req.rid, None)
        self.cache.release_req(req)

    def check_idle(self) -> None:
        if self.blocks:
            raise RuntimeError(f"{len(self.blocks)} DLLM blocks left with no request running")
        self.cache.check_idle()
