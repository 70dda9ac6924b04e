"""InputProcessor: turns user input into validated token ids and SamplingParams.

Shared by Engine and the cluster's router, so a bad request is rejected before it is queued
anywhere (and the same way everywhere)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.errors import InvalidRequestError, invalid_request_from
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_context_len: int, max_total_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # A request must fit the context and the KV pool (one slot stays free for padding).
        self.max_len = min(max_context_len, max_total_tokens - 1)

    def tokenize(self, prompt: str | None = None, input_ids: list[int] | None = None,
                 messages: list[dict] | None = None) -> list[int]:
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise InvalidRequestError("give exactly one of prompt, input_ids or messages", "prompt")
        if messages is not None:
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise InvalidRequestError("messages must be a non-empty list of objects", "messages")
            ids = self.tokenizer.encode_chat(messages)
        elif prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt must be a non-empty string", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = input_ids
        self.validate_input_ids(ids)
        return list(ids)

    def validate_input_ids(self, ids: Any) -> None:
        if not isinstance(ids, list | tuple) or not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", "prompt")

    def validate_request(self, num_input: int, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the context limit and the vocabulary."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}",
                                      "top_k")
        if not all(0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        if not all(0 <= t < vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if num_input + params.max_new_tokens > self.max_len:
            raise InvalidRequestError(
                f"prompt ({num_input} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context limit of {self.max_len} tokens", "max_tokens")

    @staticmethod
    def as_params(sp: Any) -> SamplingParams:
        if sp is None:
            return SamplingParams()
        if isinstance(sp, SamplingParams):
            return sp
        if isinstance(sp, dict):
            try:
                return msgspec.convert(sp, SamplingParams)
            except msgspec.ValidationError as e:
                raise invalid_request_from(e, "invalid sampling parameters: ") from None
        raise InvalidRequestError("sampling_params must be a SamplingParams or a dict")

    def prepare(self, prompt: Any = None, input_ids: Any = None, messages: Any = None,
                sampling_params: Any = None) -> tuple[list[list[int]], list[SamplingParams], bool]:
        """-> (token ids per request, params per request, whether the caller gave one request)."""
        if isinstance(prompt, list):
            prompts, single = [self.tokenize(prompt=p) for p in prompt], False
        elif input_ids is not None and input_ids and isinstance(input_ids[0], list | tuple):
            prompts, single = [self.tokenize(input_ids=list(x)) for x in input_ids], False
        else:
            prompts, single = [self.tokenize(prompt=prompt, input_ids=input_ids, messages=messages)], True
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params list must match the number of prompts")
        params = [self.as_params(p) for p in params]
        for ids, p in zip(prompts, params):
            self.validate_request(len(ids), p)
        return prompts, params, single
