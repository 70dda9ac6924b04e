"""InputProcessor: turns user input into validated token ids and SamplingParams.

Shared by Engine and the cluster's router, so a bad request is rejected before it is queued
anywhere (and the same way everywhere)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import msgspec

from engine.errors import InvalidRequestError, invalid_request_from
from engine.grammar import GrammarBackend, GrammarError, GrammarMatcher, create_grammar_backend
from engine.limits import DEFAULT_LIMITS, RequestLimits, count_chars
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_context_len: int, max_total_tokens: int,
                 eos_token_ids: Iterable[int] | None = None, grammar_backend: str = "llguidance",
                 json_whitespace_pattern: str | None = None, limits: RequestLimits = DEFAULT_LIMITS,
                 dllm_block_size: int = 0) -> None:
        """dllm_block_size: a block-diffusion model's block size (0: autoregressive); its requests
        take what block denoising does with (`check_dllm`)."""
        self.tokenizer = tokenizer
        self.dllm_block_size = dllm_block_size
        self.max_context_len = max_context_len
        self.max_total_tokens = max_total_tokens
        self.limits = limits  # the stop lists, grammar, messages and prompt characters are checked here
        self.vocab_size = vocab_size
        # A request must fit the context and the KV pool (one slot stays free for padding).
        self.max_len = min(max_context_len, max_total_tokens - 1)
        # Structured outputs: the backend is built on the first constrained request (a tokenizer
        # trie: ~0.1 s for a 32k vocabulary); it caches what it compiles.
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammar_backend_name = grammar_backend
        self.json_whitespace_pattern = json_whitespace_pattern  # EngineConfig.constrained_json_whitespace_pattern
        self._grammar_backend: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()

    @property
    def grammar_backend(self) -> GrammarBackend:
        with self._grammar_lock:
            if self._grammar_backend is None:
                self._grammar_backend = create_grammar_backend(
                    self.grammar_backend_name, self.tokenizer.tok.to_str(),
                    max(self.vocab_size, self.tokenizer.vocab_size), self.eos_token_ids,
                    json_whitespace_pattern=self.json_whitespace_pattern)
            return self._grammar_backend

    def compile_grammar(self, params: SamplingParams) -> object | None:
        """The compiled (cached) grammar of the request's constraint, None without one; a
        constraint that does not compile raises InvalidRequestError naming its parameter."""
        constraint = params.constraint
        if constraint is None:
            return None
        kind, spec = constraint
        try:
            return self.grammar_backend.compile(kind, spec)
        except GrammarError as e:
            what = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}[kind]
            param = {"json_schema": "response_format"}.get(kind, kind)
            raise InvalidRequestError(f"invalid {what}: {e}", param) from None

    def grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for the request's constraint (None without one)."""
        grammar = self.compile_grammar(params)
        return None if grammar is None else self.grammar_backend.matcher(grammar)

    def tokenize(self, prompt: str | None = None, input_ids: list[int] | None = None,
                 messages: list[dict] | None = None, tools: list[dict] | None = None) -> list[int]:
        """`tools` (with messages): the tool definitions the chat template renders. A prompt over
        the character or message limit is refused before any of it is tokenized."""
        if isinstance(messages, list):
            self.limits.check_messages(len(messages))
        self.check_prompt_chars(prompt, messages, tools)
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise InvalidRequestError("give exactly one of prompt, input_ids or messages", "prompt")
        if tools is not None and messages is None:
            raise InvalidRequestError("tools need messages (a chat)", "tools")
        if messages is not None:
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise InvalidRequestError("messages must be a non-empty list of objects", "messages")
            ids = self.tokenizer.encode_chat(messages, tools)
        elif prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt must be a non-empty string", "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = input_ids
        self.validate_input_ids(ids)
        return list(ids)

    def check_prompt_chars(self, prompt: Any = None, messages: Any = None, tools: Any = None) -> int:
        """The characters of a text prompt, or of a chat's messages and tools, against
        limits.max_prompt_chars: cheap, so callers run it before they hand tokenization elsewhere.
        Returns the characters counted."""
        if isinstance(prompt, str):
            self.limits.check_prompt_chars(len(prompt))
            return len(prompt)
        if messages is not None:
            chars = count_chars(messages) + count_chars(tools)
            self.limits.check_prompt_chars(chars, "messages")
            return chars
        return 0

    @staticmethod
    def validate_priority(priority: Any) -> None:
        """vLLM's request priority: any integer (lower = more important)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")

    def validate_input_ids(self, ids: Any) -> None:
        if not isinstance(ids, list | tuple) or not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", "prompt")

    def validate_request(self, num_input: int, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the request limits, the context limit and the
        vocabulary."""
        self.limits.check_stops(params.stop, params.stop_token_ids)
        self.limits.check_grammar(params.constraint)
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
        if self.dllm_block_size:
            self.check_dllm(num_input, params)
        self.compile_grammar(params)  # last: the cheap checks first

    def check_dllm(self, num_input: int, params: SamplingParams) -> None:
        """What a block-diffusion model's request cannot ask for: a block's positions are unmasked
        in confidence order, not left to right, so nothing that conditions a token on the ones
        before it applies (penalties, logit_bias, min_tokens, grammars), and no log-probability
        is computed (the unmasking reads the masked positions' distributions only). Its last block
        is denoised whole, so that block's end must fit the KV pool."""
        checks = (
            ("logprobs", params.logprobs),
            ("prompt_logprobs", params.prompt_logprobs is not None),
            ("frequency_penalty", params.frequency_penalty),
            ("presence_penalty", params.presence_penalty),
            ("repetition_penalty", params.repetition_penalty != 1.0),
            ("logit_bias", params.logit_bias),
            ("min_tokens", params.min_tokens),
        )
        for name, asked in checks:
            if asked:
                raise InvalidRequestError(f"{name} is not supported by block-diffusion models", name)
        if params.constraint is not None:
            kind = params.constraint[0]
            param = {"json_schema": "response_format"}.get(kind, kind)
            raise InvalidRequestError(f"structured outputs ({param}) are not supported by block-diffusion "
                                      f"models", param)
        bs = self.dllm_block_size
        end = min(-(-(num_input + params.max_new_tokens) // bs) * bs, self.max_context_len)
        if end > self.max_total_tokens - 1:
            raise InvalidRequestError(
                f"prompt ({num_input} tokens) + max_new_tokens ({params.max_new_tokens}), rounded up to "
                f"the block size {bs}, exceeds the KV pool of {self.max_total_tokens - 1} tokens", "max_tokens")

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
