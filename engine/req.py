"""Req: one request's Python view inside the scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.errors import ErrorKind
from engine.grammar import GrammarMatcher
from engine.sampling import PromptLogprob, SamplingParams

if TYPE_CHECKING:
    from engine.dllm.block import DllmBlock


class FinishReason:
    __slots__ = ("kind", "matched", "message", "error_kind")

    def __init__(self, kind: str, matched: int | str | None = None, message: str | None = None,
                 error_kind: ErrorKind | None = None) -> None:
        self.kind = kind  # "stop" | "length" | "abort" | "transferred" (a prefill engine's request: its KV went on)
        self.matched = matched  # the EOS/stop token id or stop string that ended it
        self.message = message  # why an abort happened
        self.error_kind = error_kind  # set with kind "abort"

    def __repr__(self) -> str:
        return f"FinishReason({self.kind!r}, {self.matched!r})"


_EMPTY = torch.empty(0, dtype=torch.int64)


class Req:
    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: SamplingParams,
                 generator: torch.Generator | None = None, priority: int = 0) -> None:
        self.rid = rid
        # vLLM's request priority: lower value = more important (default 0). The `priority`
        # eviction policy keeps the prefixes of important requests longest.
        self.priority = priority
        self.origin_input_ids = origin_input_ids
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.generator = generator  # per-request RNG: same seed, same tokens, whatever the batch
        # Prefix-match state: KV slots already present for this request, and the radix node
        # that holds the tree's part of them locked (`cache_protected_len` tokens).
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node = None
        self.cache_protected_len = 0
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # tokens whose KV is (or, once the running forward ends, will be) stored
        self.extend_input_len = 0  # tokens computed by the current extend
        self.cached_tokens = 0  # prompt tokens served from the radix cache (first admission)
        self.finished_reason: FinishReason | None = None
        self.to_abort: tuple[str, ErrorKind] | None = None  # (message, kind) once marked
        self.output_logprobs: list = []
        # Prompt logprobs: one per prompt token after the first, appended as each prefill chunk
        # runs (None unless asked for).
        self.prompt_logprobs: list[PromptLogprob] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        self.num_retractions = 0
        self.spec_state = None  # the drafter's per-request state (speculative decoding)
        # min_tokens: the ids that may not be sampled before it (EOS unless ignored, stop ids).
        self.banned_early: frozenset[int] = frozenset()
        self.stop_str_max_len = max((len(s) for s in sampling_params.stop), default=0)
        # Structured output: the request's grammar matcher (engine/grammar), set at submit. It
        # has accepted exactly output_ids (a retracted request keeps both).
        self.grammar: GrammarMatcher | None = None
        # Prefill/decode disaggregation (engine/disaggregation): the prefill side's sender, the
        # decode side's receiver and the payload it got, the transfer's timing, fetches so far.
        self.kv_sender = None
        self.kv_receiver = None
        self.kv_payload = None
        self.disagg: tuple | None = None
        self.num_kv_fetches = 0
        # Block diffusion (engine/dllm): the block being denoised, from admission until the request
        # ends (a retracted request keeps it: its unmasked positions stand).
        self.dllm_block: DllmBlock | None = None
        # LoRA (engine/lora): the adapter the request runs under (None: the base model), the id of
        # that adapter's load (its KV's namespace in the radix cache), and whether the request holds
        # a reference on the adapter (from its admission to its end, across retraction).
        self.lora_name: str | None = None
        self.lora_id = 0
        self.lora_held = False

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def needs_prompt_logits(self) -> bool:
        """Its extends keep the logits of every position (and it matches no cached prefix, whose
        positions would have none) until its prompt logprobs are complete."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.origin_input_ids) - 1

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def release_kv_state(self) -> None:
        if self.spec_state is not None:  # a draft model's KV of this request goes too
            self.spec_state = self.spec_state.release()
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.cache_protected_len = 0

    def check_finished(self, eos_ids: frozenset[int], max_context_len: int, decode_tail=None) -> None:
        """Set finished_reason after a token was appended. `decode_tail(ids) -> str` for stop strings."""
        if self.finished_reason is not None:
            return
        sp = self.sampling_params
        last = self.output_ids[-1]
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in eos_ids):
            self.finished_reason = FinishReason("stop", last)
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = FinishReason("stop")  # the output is complete: nothing may follow
        elif self.stop_str_max_len and decode_tail is not None:
            # Enough tokens to cover the longest stop string (a token is at least one char,
            # except byte-fallback pieces: +8 covers a split multi-byte character).
            tail = decode_tail(self.output_ids[-(self.stop_str_max_len + 8):])
            for s in sp.stop:
                if s in tail:
                    self.finished_reason = FinishReason("stop", s)
                    return
        if self.finished_reason is None and (
                len(self.output_ids) >= sp.max_new_tokens or self.seqlen >= max_context_len):
            self.finished_reason = FinishReason("length")

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
