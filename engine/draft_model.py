"""The draft-model drafter: a small model with the target's tokenizer proposes up to k tokens per
request for a TARGET_VERIFY batch.

It owns a ModelRunner of its own (weights, KV pool, request rows); the target's radix cache is
not shared, because a draft model's KV is cheap to recompute. Per verify step it runs one
DRAFT_EXTEND_V2 batch, which catches each request's draft KV up on the tokens the draft model has
not seen (the whole prompt at first, then what the last verify emitted) and yields the first
draft, then one DECODE batch per further draft position. Drafts are the draft model's argmax: a
deterministic proposal (q one-hot), which is what the verify rule for sampling assumes.

What the draft model was fed beyond the accepted tokens is matched against the request's tokens
at the next proposal: the part that agrees keeps its KV, the rest goes back to the pool."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from engine.config import DEFAULT_MAX_PREFILL_TOKENS, EngineConfig, ModelConfig
from engine.errors import ConfigError, MemoryInvariantError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_path import resolve_model_path
from engine.model_runner import ModelRunner
from engine.req import Req
from engine.speculative import AdaptiveDepth, Drafter

log = logging.getLogger("radixray.engine")
_EMPTY = torch.empty(0, dtype=torch.int64)


class _DraftState(AdaptiveDepth):
    """A request's draft KV: its row in the draft pool and how many positions it holds, of which
    the last len(fed) are the drafts fed from position fed_from (unconfirmed)."""

    __slots__ = ("drafter", "row", "kv_len", "fed_from", "fed")

    def __init__(self, drafter: DraftModelDrafter, row: int, depth: int) -> None:
        super().__init__(depth)
        self.drafter, self.row, self.kv_len = drafter, row, 0
        self.fed_from, self.fed = 0, []

    def release(self) -> None:
        self.drafter.release(self)


@dataclass
class _Work:
    """One request of a proposal: its draft KV is fed up to fed_end, then n drafts are made."""

    index: int
    state: _DraftState
    tokens: list[int]
    fed_end: int
    n: int

    @property
    def new_positions(self) -> int:
        """Draft KV slots this proposal writes: the catch-up, then a draft per decode step."""
        return self.fed_end - self.state.kv_len + max(self.n - 1, 0)


class DraftModelDrafter(Drafter):
    def __init__(self, config: EngineConfig, target: ModelConfig, target_context_len: int, max_running: int,
                 pool_tokens: int, batches_by_mode: Counter | None = None) -> None:
        super().__init__(config.speculative_num_draft_tokens)
        path = resolve_model_path(config.speculative_draft_model_path)
        vocab = ModelConfig.from_dir(path).vocab_size  # checked before the weights load
        if vocab != target.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({vocab} tokens) differs from the target's "
                              f"({target.vocab_size}): they must share a tokenizer")
        draft_config = config.replace(speculative_algorithm=None, speculative_draft_model_path=None,
                                      max_total_tokens=pool_tokens, max_running_requests=max_running,
                                      max_context_len=target_context_len + self.k, enable_overlap_schedule=False,
                                      tp_size=1)  # a draft runs whole on rank 0 of a tensor-parallel target
        self.runner = ModelRunner(draft_config, path)
        self.device = self.runner.device
        self.rows = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        # A catch-up extend runs inside scheduling: at most this many tokens per proposal.
        self.max_catch_up = config.chunked_prefill_size or config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS
        self.live: dict[int, _DraftState] = {}  # by row: the states holding draft KV
        self.failures = 0  # proposals whose draft forwards raised (the step decoded plainly)
        self.batches_by_mode = Counter() if batches_by_mode is None else batches_by_mode

    # ---- per-request state -----------------------------------------------------------------
    def _state(self, req: Req) -> _DraftState | None:
        state = req.spec_state
        if state is None:
            row = self.rows.alloc()
            if row is None:
                return None
            state = req.spec_state = self.live[row] = _DraftState(self, row, self.k)
        return state

    def _slots(self, state: _DraftState, start: int, end: int) -> torch.Tensor:
        return self.rows.req_to_token[state.row, start:end].to(torch.int64)

    def _reconcile(self, state: _DraftState, tokens: list[int]) -> None:
        """Keep the fed drafts the request's tokens agree with (a plain decode step may have come
        between: the pool had no room for a verify); free the KV of the others."""
        keep = state.fed_from
        for j, t in enumerate(state.fed):
            if state.fed_from + j >= len(tokens) or tokens[state.fed_from + j] != t:
                break
            keep += 1
        keep = min(keep, state.kv_len) if state.fed else state.kv_len
        # The last token is always fed again: its logits give the first draft.
        keep = min(keep, len(tokens) - 1)
        if keep < state.kv_len:
            self.allocator.free(self._slots(state, keep, state.kv_len))
            state.kv_len = keep
        state.fed = []

    def release(self, state: _DraftState) -> None:
        """The request ended or was retracted: its draft KV and row go back to the pool."""
        if self.live.get(state.row) is not state:
            return
        del self.live[state.row]
        self.allocator.free(self._slots(state, 0, state.kv_len))
        self.rows.free(state.row)
        state.kv_len, state.fed = 0, []

    # ---- proposals -------------------------------------------------------------------------
    def propose(self, req: Req, limit: int) -> list[int]:
        return self.propose_batch([req], [limit])[0]

    def propose_batch(self, reqs: list[Req], limits: list[int], room: int | None = None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        room = (1 << 62) if room is None else room  # draft tokens the target's pool can verify
        catch_up, free = self.max_catch_up, self.allocator.available_size()
        work: list[_Work] = []
        for i, (req, limit) in enumerate(zip(reqs, limits)):
            state = self._state(req)
            if state is None:
                continue
            tokens = req.fill_ids
            self._reconcile(state, tokens)
            ctx = self.runner.max_context_len
            if len(tokens) >= ctx:  # longer than the draft model's context: no drafts for it
                continue
            # Draft KV is written up to position len(tokens) + n - 2: within the draft's context.
            n = min(state.depth_now(min(limit, ctx - len(tokens) + 1)), room)
            unseen = len(tokens) - state.kv_len
            if unseen > catch_up:  # too long for this step: catch up on part of it, no draft yet
                unseen, n = catch_up, 0
            if unseen == 0 or unseen + max(n - 1, 0) > free:
                continue
            work.append(_Work(i, state, tokens, state.kv_len + unseen, n))
            catch_up, free, room = catch_up - unseen, free - unseen - max(n - 1, 0), room - n
        if not work:
            return drafts
        slots = self.allocator.alloc(sum(w.new_positions for w in work))
        at = 0
        for w in work:  # each request's new positions, in order
            self.rows.write(w.state.row, w.state.kv_len, slots[at:at + w.new_positions])
            at += w.new_positions
        try:
            self._run(work, drafts)
        except Exception:  # drafting is an optimisation: this step decodes plainly instead
            log.exception("draft model forward failed; decoding without drafts this step")
            self.failures += 1
            self.allocator.free(slots)
            for w in work:
                w.state.fed = []
            return [[] for _ in reqs]
        for w in work:
            w.state.kv_len += w.new_positions
        return drafts

    def _run(self, work: list[_Work], drafts: list[list[int]]) -> None:
        """The catch-up extend (first drafts), then a DECODE step per further draft."""
        first = self._extend(work)
        for w, token in zip(work, first):
            if w.n:
                drafts[w.index].append(token)
                w.state.fed_from = w.fed_end
        for step in range(1, max(w.n for w in work)):
            active = [w for w in work if w.n > step]
            nxt = self._decode([(w.state, w.fed_end + step - 1, drafts[w.index][-1]) for w in active])
            for w, token in zip(active, nxt):
                w.state.fed.append(drafts[w.index][-1])
                drafts[w.index].append(token)

    def _extend(self, work: list[_Work]) -> list[int]:
        """DRAFT_EXTEND_V2: each request's unseen tokens (up to fed_end) over its draft KV; the
        argmax after its last."""
        prefix = [w.state.kv_len for w in work]
        seq_lens = [w.fed_end for w in work]
        input_ids = [t for w in work for t in w.tokens[w.state.kv_len:w.fed_end]]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=len(work),
            input_ids=torch.tensor(input_ids, dtype=torch.int64), seq_lens=torch.tensor(seq_lens),
            out_cache_loc=torch.cat([self._slots(w.state, p, s) for w, p, s in zip(work, prefix, seq_lens)]),
            req_pool_indices=torch.tensor([w.state.row for w in work], device=self.device),
            positions=_EMPTY, seq_lens_cpu=seq_lens)
        ext = [s - p for p, s in zip(prefix, seq_lens)]
        starts = fb.set_extend_layout(prefix, ext)
        fb.last_token_indices = torch.tensor([s + n - 1 for s, n in zip(starts, ext)])
        self.batches_by_mode[ForwardMode.DRAFT_EXTEND_V2.name] += 1
        return self.runner.forward(fb).argmax(dim=-1).tolist()

    def _decode(self, rows: list[tuple[_DraftState, int, int]]) -> list[int]:
        """One DECODE step: (state, position, token) per request; the argmax after each."""
        positions = [pos for _, pos, _ in rows]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows),
            input_ids=torch.tensor([t for *_, t in rows], dtype=torch.int64),
            seq_lens=torch.tensor([p + 1 for p in positions]),
            out_cache_loc=torch.cat([self._slots(state, p, p + 1) for state, p, _ in rows]),
            req_pool_indices=torch.tensor([state.row for state, _, _ in rows], device=self.device),
            positions=torch.tensor(positions), seq_lens_cpu=[p + 1 for p in positions],
            last_token_indices=torch.arange(len(rows)))
        return self.runner.forward(fb).argmax(dim=-1).tolist()

    # ---- integrity -------------------------------------------------------------------------
    def check_idle(self) -> None:
        if self.live:
            raise MemoryInvariantError(f"draft KV of {len(self.live)} request(s) still held with none running")
        if self.allocator.available_size() != self.allocator.size:
            raise MemoryInvariantError(f"draft KV leak: {self.allocator.size - self.allocator.available_size()} slots")
        if self.rows.available_size() != self.rows.size:
            raise MemoryInvariantError(f"draft request rows leaked: {self.rows.size - self.rows.available_size()}")
