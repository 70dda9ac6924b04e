"""Speculative decoding: drafters propose tokens, a TARGET_VERIFY forward scores them all at once,
and `verify` keeps the longest prefix the target agrees with plus one token of its own.

Acceptance keeps the target's distribution exactly. Greedy: a draft is kept while it equals the
target's argmax. Sampling (a drafter that proposes one token deterministically, q = one-hot):
draft d is kept with probability p(d); on a rejection the token comes from p with d removed
(renormalised), which is max(p - q, 0) normalised; if every draft is kept, the bonus token comes
from p at the last position. p is what the plain sampler would sample from at that position:
the same penalties (over the output including the drafts before it), temperature, top-k/p, min-p."""

from __future__ import annotations

import msgspec
import torch

from engine.req import Req
from engine.sampling import apply_penalties, filtered_probs


class AdaptiveDepth:
    """A request's drafting depth: it doubles (up to k) after a verify that kept every draft,
    halves after one that kept none, and at zero the request decodes plainly for COOLDOWN steps."""

    __slots__ = ("depth", "cooldown")

    def __init__(self, depth: int) -> None:
        self.depth, self.cooldown = depth, 0

    def depth_now(self, limit: int) -> int:
        """How many drafts to propose this step (0 while cooling down, counting the step)."""
        if self.cooldown:
            self.cooldown -= 1
            return 0
        return max(0, min(self.depth, limit))

    def release(self) -> AdaptiveDepth | None:
        """The request's KV was released (it ended or was retracted): the state to keep (None:
        start afresh). A drafter whose state holds memory frees it here."""
        return self


class Drafter:
    """What the scheduler asks of a drafter: up to `limit` draft tokens per running request, and
    feedback after each verify. Per-request state lives in `req.spec_state` (an AdaptiveDepth)."""

    COOLDOWN = 8

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, req: Req, limit: int) -> list[int]:
        """Up to `limit` drafts for one request (a drafter implements this or propose_batch)."""
        raise NotImplementedError

    def propose_batch(self, reqs: list[Req], limits: list[int], room: int | None = None) -> list[list[int]]:
        """Drafts for each request, up to its limit; `room`: how many draft tokens in all the
        target's pool can verify (None: no bound). The scheduler decodes plainly when the
        drafts it gets do not fit."""
        return [self.propose(r, limit) for r, limit in zip(reqs, limits)]

    def feedback(self, req: Req, drafted: int, accepted: int) -> None:
        state = req.spec_state
        if state is None or drafted == 0:
            return
        if accepted == drafted:
            state.depth = min(self.k, 2 * state.depth)
        elif accepted == 0:
            state.depth //= 2
            if state.depth == 0:
                state.depth, state.cooldown = 1, self.COOLDOWN

    def check_idle(self) -> None:
        """The idle invariant of the drafter's own memory, if it has any."""


class NgramDrafter(Drafter):
    """Prompt lookup: the last n tokens (n from max_n down to min_n) are looked up among the
    request's earlier tokens; the k tokens that followed their latest occurrence are the draft
    (a continuation that runs into the present repeats with the match's period, as a loop
    would). Each request keeps an index n-gram -> where its latest continuation starts,
    extended as tokens arrive, so a proposal costs O(k), not a scan of the sequence. Depth
    adapts per request (AdaptiveDepth)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        super().__init__(k)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Req, limit: int) -> list[int]:
        """Up to min(depth, limit) draft tokens for the request's next positions."""
        tokens = req.fill_ids
        state = req.spec_state or _NgramState(self.k)
        for e in range(max(state.indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                state.index[tuple(tokens[e - n:e])] = e
        state.indexed = len(tokens)
        req.spec_state = state
        limit = state.depth_now(limit)
        if limit <= 0:
            return []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = state.index.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                draft: list[int] = []
                for pos in range(start, start + limit):
                    draft.append(tokens[pos] if pos < len(tokens) else draft[pos - len(tokens)])
                return draft
        return []


class _NgramState(AdaptiveDepth):
    __slots__ = ("index", "indexed")

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens whose n-grams are in the index


class VerifyResult(msgspec.Struct):
    """Per request of a verify batch: the tokens to emit (accepted drafts, then the target's
    own), their logprobs when asked, and whether its logits were unusable (the request fails)."""

    tokens: list[list[int]]
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    bad: list[bool]
    drafted: int  # draft tokens scored
    accepted: int  # draft tokens kept


def verify(logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]]) -> VerifyResult:
    """logits [sum(1 + len(d)), vocab]: for each request, its 1 + len(d) positions in order."""
    logits = raw = logits.float()
    fits = [len(d) for d in drafts]
    if any(getattr(r, "grammar", None) is not None for r in reqs):
        logits, fits = _grammar_masks(logits, reqs, drafts)
    # One pass over the batch for the common case (greedy, no penalties): argmax and the
    # finiteness check of every row, copied to the host once.
    row_ok = torch.isfinite(logits.amax(dim=-1)).tolist()
    row_argmax = logits.argmax(dim=-1).tolist()
    tokens, logprobs, bad = [], [], []
    drafted = accepted = start = 0
    for req, full_draft, fit in zip(reqs, drafts, fits):
        # A constrained request's drafts end before the first one its grammar forbids: the
        # target's (masked) distribution gives that one no mass, so it would be rejected anyway.
        all_rows, draft = 1 + len(full_draft), full_draft[:fit]
        n_rows = 1 + len(draft)
        params = req.sampling_params
        if params.is_greedy and not params.has_penalties:
            ok, target = all(row_ok[start:start + n_rows]), row_argmax[start:start + n_rows]
        else:
            rows = logits[start:start + n_rows]
            if params.has_penalties:
                rows = rows.clone()
                for j in range(n_rows):
                    apply_penalties(rows[j], params, req.origin_input_ids, req.output_ids + draft[:j],
                                    req.banned_early)
            ok = bool(torch.isfinite(rows.amax(dim=-1)).all())
            target = rows.argmax(dim=-1).tolist() if ok and params.is_greedy else None
        if ok and target is None:  # sampling
            probs = filtered_probs(rows, [params] * n_rows)
            ok = bool(torch.isfinite(probs.sum(dim=-1)).all())
            out = _rejection_sample(probs, draft, req.generator) if ok else []
        elif ok:
            n = 0
            while n < len(draft) and draft[n] == target[n]:
                n += 1
            out = draft[:n] + [target[n]]
        if not ok:
            tokens.append([]), logprobs.append(None), bad.append(True)
            start += all_rows
            continue
        drafted += len(full_draft)
        accepted += len(out) - 1
        tokens.append(out)
        bad.append(False)
        logprobs.append(_logprobs(raw[start:start + n_rows], out, params) if params.logprobs else None)
        start += all_rows
    return VerifyResult(tokens, logprobs, bad, drafted, accepted)


def _grammar_masks(logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Mask each constrained request's positions with its grammar's state there (after the
    drafts before it), and count the drafts its grammar accepts; rows past the first forbidden
    draft stay unmasked (nothing is taken from them), and so does the row after a draft that
    completes the grammar (the request ends at that draft). Each matcher ends where it began."""
    backend = next(r.grammar.backend for r in reqs if getattr(r, "grammar", None) is not None)
    bitmask = backend.new_bitmask(logits.shape[0])
    fits, start = [], 0
    for req, draft in zip(reqs, drafts):
        m = getattr(req, "grammar", None)
        fit = len(draft)
        if m is not None:
            fit = m.accept_prefix(draft)
            for j in range(fit, -1, -1):  # from the state after the last fitting draft back to now
                if not m.is_terminated():
                    m.fill_bitmask(bitmask, start + j)
                if j:
                    m.rollback(1)
        fits.append(fit)
        start += 1 + len(draft)
    return backend.apply_bitmask(logits, bitmask.to(logits.device)), fits


def _rejection_sample(probs: torch.Tensor, draft: list[int], gen: torch.Generator | None) -> list[int]:
    out = []
    for j, d in enumerate(draft):
        u = torch.rand((), generator=gen, device=probs.device)
        if u < probs[j, d]:
            out.append(d)
            continue
        residual = probs[j].clone()  # p(d) < 1 here, so some mass is left
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=gen)[0]))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=gen)[0]))
    return out


def _logprobs(rows: torch.Tensor, out: list[int], params) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw-distribution logprobs (as the plain sampler reports) of each emitted token."""
    lp = torch.log_softmax(rows[:len(out)], dim=-1)
    result = []
    for j, t in enumerate(out):
        top = []
        if params.top_logprobs:
            vals, idx = torch.topk(lp[j], params.top_logprobs)
            top = list(zip(idx.tolist(), vals.tolist()))
        result.append((float(lp[j, t]), top))
    return result
