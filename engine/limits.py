"""RequestLimits: every size limit a request meets before any work is done for it (one config
section, `limits`, shared by the engine, the HTTP front ends and the batch job).

The engine checks the stop lists and the structured-output spec
(`InputProcessor.validate_request`) and the messages and characters of a prompt it tokenizes
(`InputProcessor.tokenize`), so they hold for direct `Engine` users too; the front end
(deploy/app.py) also checks body bytes (while reading), prompts and choices per request, and
checks the rest before it tokenizes or compiles anything; the batch job checks a line's bytes.

What others allow, for the defaults: OpenAI takes at most 4 stop sequences, n up to 128, an
array of up to 2048 prompts in one completions request and message contents of up to 1,048,576
characters; vLLM limits none of these (only the context, after tokenization). The defaults below
are at least as generous as OpenAI's, except that they bound what OpenAI does not state (stop
string length, stop_token_ids, prompts x n, messages, grammar size)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType

import msgspec

from engine.errors import ConfigError, InvalidRequestError


class LimitExceededError(InvalidRequestError):
    """A request over one of the RequestLimits: the message names the limit and its value."""

    code = "limit_exceeded"

    def __init__(self, message: str, param: str | None, limit: str, value: int) -> None:
        super().__init__(f"{message} (limit {limit}={value})", param)
        self.limit, self.value = limit, value


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Request size limits (the comment above each field is its CLI help line)."""

    # HTTP: bytes of a request body, counted as it is read (413 past it, however it is sent);
    # batch job: bytes of one input line.
    max_body_bytes: int = 4 << 20
    # Prompts in one completions request (OpenAI takes 2048).
    max_prompts: int = 2048
    # Choices of one request, prompts x n: each is an engine request of its own.
    max_choices: int = 2048
    # Characters of one prompt (a chat: its messages and tools) before it is tokenized (OpenAI
    # takes 1,048,576 a message).
    max_prompt_chars: int = 1 << 20
    # Messages of one chat, counted before any of them is rendered or tokenized.
    max_messages: int = 4096
    # Stop strings of one request (OpenAI takes 4).
    max_stop_strings: int = 16
    # Characters of one stop string (each step decodes that many output tokens to look for it).
    max_stop_str_len: int = 256
    # Entries of stop_token_ids.
    max_stop_token_ids: int = 1024
    # Characters of a structured-output spec (a JSON schema, regex or EBNF grammar; a tool's
    # parameters schema too): compiling one takes time and memory that grow with it. Specs over
    # 1 MiB are refused whatever this is (SamplingParams).
    max_grammar_chars: int = 256 << 10
    # Tokenizations and chat templates running at once in one front-end replica (a thread pool
    # off its event loop; the others wait their turn).
    tokenize_threads: int = 2

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"limits: {name} must be an integer >= 1, got {value!r}")

    def check_choices(self, prompts: int, n: int) -> None:
        """Prompts in one request and prompts x n (before any prompt is tokenized)."""
        if prompts > self.max_prompts:
            raise LimitExceededError(f"{prompts} prompts in one request", "prompt", "max_prompts", self.max_prompts)
        if prompts * n > self.max_choices:
            raise LimitExceededError(f"{prompts} prompts x n={n} = {prompts * n} choices in one request",
                                     "n", "max_choices", self.max_choices)

    def check_stops(self, stop: Sequence[str] | str | None, stop_token_ids: Collection[int] | None) -> None:
        """Counts and lengths only: cheap on lists of any size (checked before they are copied)."""
        if isinstance(stop, str):
            stop = (stop,)
        stop = stop or ()
        if len(stop) > self.max_stop_strings:
            raise LimitExceededError(f"{len(stop)} stop strings", "stop", "max_stop_strings", self.max_stop_strings)
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        if longest > self.max_stop_str_len:
            raise LimitExceededError(f"a stop string of {longest} characters", "stop", "max_stop_str_len",
                                     self.max_stop_str_len)
        count = len(stop_token_ids or ())
        if count > self.max_stop_token_ids:
            raise LimitExceededError(f"{count} stop_token_ids", "stop_token_ids", "max_stop_token_ids",
                                     self.max_stop_token_ids)

    def check_grammar(self, constraint: tuple[str, str] | None) -> None:
        """A request's structured-output spec, (kind, spec) as SamplingParams.constraint gives it
        (before it is compiled)."""
        if constraint is not None and len(constraint[1]) > self.max_grammar_chars:
            kind, spec = constraint
            raise LimitExceededError(f"a {kind} of {len(spec)} characters", _GRAMMAR_PARAMS.get(kind, kind),
                                     "max_grammar_chars", self.max_grammar_chars)

    def check_messages(self, count: int) -> None:
        """The messages of one chat (before they are copied, rendered or tokenized)."""
        if count > self.max_messages:
            raise LimitExceededError(f"{count} messages in one chat", "messages", "max_messages", self.max_messages)

    def check_prompt_chars(self, chars: int, param: str = "prompt") -> None:
        if chars > self.max_prompt_chars:
            raise LimitExceededError(f"a prompt of {chars} characters", param, "max_prompt_chars",
                                     self.max_prompt_chars)


DEFAULT_LIMITS = RequestLimits()
# The request parameter that carries each kind of structured-output spec.
_GRAMMAR_PARAMS = MappingProxyType({"json_schema": "response_format"})

def count_chars(value: object) -> int:
    """Characters of every string in a JSON-like value (messages, tools), dict keys included;
    iterative, so a deeply nested value costs no recursion."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            for k, item in v.items():
                total += len(k) if isinstance(k, str) else 0
                stack.append(item)
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return total
