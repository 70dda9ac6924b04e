"""Sampling parameters (validated on construction) and the batched sampler."""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec
import torch

from engine.errors import InvalidRequestError
from engine.grammar import GrammarBackend

# Below this a temperature is greedy (vLLM's epsilon): dividing logits by it would overflow.
TEMPERATURE_EPS = 1e-5
# Penalty factors outside this range push float32 logits to inf or to 0 for no visible effect.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
MAX_INT32 = (1 << 31) - 1
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar (the HTTP body limit is 4 MiB)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    # A set: every step looks each request's new token up in it. Its size is a request limit
    # (engine/limits.py), as are the stop strings' count and length.
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's prompt_logprobs: the logprob, rank and top-k of every prompt token after the first
    # (None: off). The request then computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many outputs
    # Structured output (SGLang's names; at most one): the output must match a JSON schema (as a
    # JSON string), a regular expression, or an EBNF grammar. The sampler masks every other token.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        # Direct construction skips msgspec's type checks: normalise and re-check here.
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        msgspec.structs.force_setattr(self, "stop", tuple(self.stop or ()))
        stop_ids = self.stop_token_ids if isinstance(self.stop_token_ids, frozenset) else tuple(self.stop_token_ids or ())
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise InvalidRequestError("stop_token_ids must be integers", "stop_token_ids")
        msgspec.structs.force_setattr(self, "stop_token_ids", frozenset(stop_ids))
        if isinstance(self.logit_bias, dict):
            msgspec.structs.force_setattr(self, "logit_bias", tuple(self.logit_bias.items()))
        msgspec.structs.force_setattr(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias or ()))
        for name, kinds in _FIELD_KINDS.items():
            v = getattr(self, name)
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                raise InvalidRequestError(f"{name} has the wrong type: {type(v).__name__}", name)
            if float in kinds and not _is_finite(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v}", name)
        if 0.0 < self.temperature < TEMPERATURE_EPS:
            msgspec.structs.force_setattr(self, "temperature", 0.0)
        if self.seed is not None:  # any integer seeds a 64-bit generator
            msgspec.structs.force_setattr(self, "seed", self.seed % (1 << 64))

        def need(cond: bool, msg: str, param: str) -> None:
            if not cond:
                raise InvalidRequestError(msg, param)

        need(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}", "max_tokens")
        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}", "temperature")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        need(self.max_new_tokens <= MAX_INT32, f"max_new_tokens must be < 2^31, got {self.max_new_tokens}",
             "max_tokens")
        need(-1 <= self.top_k <= MAX_INT32, f"top_k must be -1 (off) or in [0, 2^31), got {self.top_k}", "top_k")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty")
        lo, hi = REPETITION_PENALTY_RANGE
        need(lo <= self.repetition_penalty <= hi, f"repetition_penalty must be in [{lo}, {hi}], got "
             f"{self.repetition_penalty}", "repetition_penalty")
        need(0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]", "top_logprobs")
        need(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]",
             "prompt_logprobs")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty", "stop")
        need(all(len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
                 and isinstance(pair[1], int | float) and not isinstance(pair[1], bool) and _is_finite(pair[1])
                 and -100.0 <= pair[1] <= 100.0 for pair in self.logit_bias),
             "logit_bias maps token ids to numbers in [-100, 100]", "logit_bias")
        need(len(self.logit_bias) <= 1024, "at most 1024 logit_bias entries", "logit_bias")
        need(0 <= self.min_tokens <= self.max_new_tokens, f"min_tokens must be in [0, max_tokens], got "
             f"{self.min_tokens}", "min_tokens")
        constraints = [name for name in _CONSTRAINT_PARAMS if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise InvalidRequestError("give at most one of response_format (JSON), regex and ebnf",
                                      _CONSTRAINT_PARAMS[constraints[-1]])
        for name in constraints:
            spec = getattr(self, name)
            need(0 < len(spec) <= MAX_GRAMMAR_CHARS, f"{name} must be a non-empty string of at most "
                 f"{MAX_GRAMMAR_CHARS} characters", _CONSTRAINT_PARAMS[name])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of its structured-output constraint: kind is "json_schema", "regex" or "ebnf"."""
        for name in _CONSTRAINT_PARAMS:
            spec = getattr(self, name)
            if spec is not None:
                return name, spec
        return None

    @property
    def has_penalties(self) -> bool:
        """Its logits are adjusted before sampling (penalties, logit_bias, min_tokens): the
        sampler needs the request's output so far."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


def _is_finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


_FIELD_KINDS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,), "temperature": (int, float), "top_p": (int, float), "top_k": (int,),
    "min_p": (int, float), "seed": (int, type(None)), "frequency_penalty": (int, float),
    "presence_penalty": (int, float), "repetition_penalty": (int, float), "ignore_eos": (bool,),
    "logprobs": (bool,), "top_logprobs": (int,), "prompt_logprobs": (int, type(None)),
    "skip_special_tokens": (bool,), "min_tokens": (int,),
    "json_schema": (str, type(None)), "regex": (str, type(None)), "ebnf": (str, type(None)),
}
# Constraint field -> the request parameter that carries it (the OpenAI body's name).
_CONSTRAINT_PARAMS = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}


class PromptLogprob(msgspec.Struct, array_like=True):
    """One prompt token's logprob given the tokens before it (the token id is the prompt's)."""

    logprob: float
    rank: int  # 1 + the number of tokens the model found more likely
    top_logprobs: list[tuple[int, float]]


class RowLogprobs(NamedTuple):
    """What the sampler reports for one request beside its token (index 0 and 1 are what
    speculative verification reports as a plain tuple)."""

    chosen: float | None  # the sampled token's logprob (None unless logprobs was asked)
    top: list[tuple[int, float]]
    # Prompt positions whose logits this forward kept (a chunk of the prompt, in order).
    prompt: list[PromptLogprob] | None = None


class SampleResult(msgspec.Struct):
    # -1 for a void row (its logits or probabilities were not finite): that request fails.
    next_token_ids: list[int]
    # Per row, None unless the request asked for logprobs or prompt logprobs.
    logprobs: list[RowLogprobs | None]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int], banned_early: frozenset[int] = frozenset()) -> None:
    """In place on one row: OpenAI frequency/presence (outputs), HF repetition (all tokens),
    logit_bias, and min_tokens (`banned_early`, the EOS and stop ids, cannot come yet)."""
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.numel())
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if len(output_ids) < params.min_tokens and banned_early:
        logits[list(banned_early)] = float("-inf")


def sample_on_device(logits: torch.Tensor, reqs: list,
                     partial: frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Pick one token per row. `reqs` carry `.sampling_params`, `.generator`, ids for penalties.
    Rows in `partial` (prompt chunks whose token is discarded) take the argmax: no RNG draw.
    Returns (ids, bad, logprobs). The ids and `bad` (a bool per row: its logits or probabilities
    were not finite, so its id is void) stay on the logits' device, with no host sync, so the
    caller decides when to copy them; logprobs, computed only when a request asks, are host
    values already. No input makes this raise: a bad row is flagged, never sampled from.
    Constrained requests (`.grammar`, a matcher) sample only what their grammar allows: the
    bitmask is filled on the host first, so on a GPU that overlaps the forward still running.
    Requests that need prompt logits (prompt logprobs) kept a row per position of their extend:
    those rows become PromptLogprobs here and each request's last row is sampled (a row count
    that does not add up is a bug, and raises)."""
    prompt: list[list[PromptLogprob] | None] = [None] * len(reqs)
    if any(getattr(r, "needs_prompt_logits", False) for r in reqs):
        logits, prompt = split_prompt_logits(logits, reqs)
    matchers = [getattr(r, "grammar", None) for r in reqs]
    grammar_mask = grammar_bitmask(matchers, logits.device)
    logits = logits.float()
    want_logprobs = [r.sampling_params.logprobs for r in reqs]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    if any(r.sampling_params.has_penalties for r in reqs):
        logits = logits.clone()
        for i, r in enumerate(reqs):
            if r.sampling_params.has_penalties:
                apply_penalties(logits[i], r.sampling_params, r.origin_input_ids, r.output_ids, r.banned_early)
    if grammar_mask is not None:  # in place: the raw logprobs are taken, and callers do not reuse logits
        logits = grammar_mask[0].apply_bitmask(logits, grammar_mask[1], inplace=True)

    # max() propagates NaN and +inf, and is -inf only when nothing can be sampled; masked (-inf)
    # tokens beside finite ones are fine. One reduction per row, not an isfinite pass over all.
    bad = ~torch.isfinite(logits.amax(dim=-1))
    next_ids = torch.argmax(logits, dim=-1)
    random_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.is_greedy and i not in partial]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits[rows], [reqs[i].sampling_params for i in random_rows])
        mass = probs.sum(dim=-1)  # NaN if any probability is
        ok = torch.isfinite(mass) & (mass > 0)
        bad[rows] |= ~ok
        probs = torch.where(ok.unsqueeze(1), probs, torch.ones_like(probs))  # never sampled from
        for j, i in enumerate(random_rows):
            next_ids[i] = torch.multinomial(probs[j], 1, generator=reqs[i].generator)[0]

    out: list[RowLogprobs | None] = [None if p is None else RowLogprobs(None, [], p) for p in prompt]
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
        for i, r in enumerate(reqs):
            if want_logprobs[i]:
                top = []
                if r.sampling_params.top_logprobs:
                    vals, idx = torch.topk(raw_logprobs[i], r.sampling_params.top_logprobs)
                    top = list(zip(idx.tolist(), vals.tolist()))
                out[i] = RowLogprobs(chosen[i], top, prompt[i])
    return next_ids, bad, out


PROMPT_LOGPROB_ROWS = 512  # prompt positions per log-softmax: bounds the float32 temporaries


def split_prompt_logits(logits: torch.Tensor, reqs: list) -> tuple[torch.Tensor, list[list[PromptLogprob] | None]]:
    """Rows of a forward where requests that need prompt logits (`req.needs_prompt_logits`) kept
    one row per token of their extend, the others one: (each request's last row, to sample
    from; each request's PromptLogprobs, None for the others). Row j of such a request is
    position kv_len - extend_input_len + j, whose logits score the prompt token after it."""
    counts = [r.extend_input_len if r.needs_prompt_logits else 1 for r in reqs]
    if sum(counts) != logits.shape[0]:
        raise RuntimeError(f"{logits.shape[0]} logit rows for a batch that needs {sum(counts)}")
    last, prompt, at = [], [], 0
    for r, n in zip(reqs, counts):
        last.append(at + n - 1)
        if r.needs_prompt_logits:
            start = r.kv_len - n  # the first position of this extend
            # (the row at the prompt's last position scores no prompt token: it is sampled from)
            targets = r.origin_input_ids[start + 1:start + n + 1]
            prompt.append(prompt_logprobs(logits[at:at + len(targets)], targets, r.sampling_params.prompt_logprobs))
        else:
            prompt.append(None)
        at += n
    return logits[torch.tensor(last, device=logits.device)], prompt


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """Row i of `logits` scores targets[i]: its logprob, its rank, and the top k."""
    out: list[PromptLogprob] = []
    for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(logits[a:a + PROMPT_LOGPROB_ROWS].float(), dim=-1)
        tgt = torch.tensor(targets[a:a + PROMPT_LOGPROB_ROWS], device=lp.device)
        chosen = lp.gather(1, tgt.unsqueeze(1))
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in ranks]
        if k:
            vals, idx = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        out += [PromptLogprob(c, r, t) for c, r, t in zip(chosen.squeeze(1).tolist(), ranks, tops)]
    return out


def grammar_bitmask(matchers: list, device: torch.device) -> tuple[GrammarBackend, torch.Tensor] | None:
    """(backend, bitmask on `device`) for rows with a grammar matcher (None in a row: no
    constraint, all allowed); None when no row has one."""
    first = next((m for m in matchers if m is not None), None)
    if first is None:
        return None
    backend = first.backend
    return backend, backend.batch_bitmask(matchers, device)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, on a batch of rows; returns probabilities."""
    dev = logits.device
    # Capped: a float32 inf would turn masked (-inf) logits into NaN; 1e30 is already uniform.
    temps = torch.tensor([min(p.temperature, 1e30) for p in params], device=dev).unsqueeze(1)
    logits = logits / temps
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=dev).unsqueeze(1)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    # Keep a token while the mass before it is below top_p (the first token always stays).
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > top_p
    min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
    drop |= sorted_probs < min_p * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, sorted_idx, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
