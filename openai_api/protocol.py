"""OpenAI request bodies (msgspec) and how they map to SamplingParams."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import msgspec

from engine import InvalidRequestError, SamplingParams
from openai_api.params import (
    NamedToolChoice,
    OpenAISampling,
    OpenAITools,
    Tool,
    message_tool_calls,
)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far on every chunk (vLLM's option)

MAX_N = 128


class _Common(OpenAISampling, kw_only=True):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI does."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None

    def to_sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                    default_max_tokens: int) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        return self.sampling_params(default_max_tokens, max_tokens, logprobs, top_logprobs)

    def validate(self) -> None:
        """Checks msgspec's types cannot express; raises InvalidRequestError."""
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs are not available when streaming (as in vLLM)",
                                      "prompt_logprobs")

    def num_prompts(self) -> int:
        """How many prompts the body holds, counted without building them (the limits are checked
        on it first)."""
        return 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids (checked below)
    logprobs: int | None = None
    echo: bool = False

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        n = self.logprobs or 0
        params = self.to_sampling(self.max_tokens, self.logprobs is not None, n, default_max_tokens)
        if self.echo and self.logprobs is not None:  # the echoed prompt comes with its logprobs
            params = msgspec.structs.replace(params, prompt_logprobs=max(n, self.prompt_logprobs or 0))
        return params

    def num_prompts(self) -> int:
        p = self.prompt
        if isinstance(p, str) or not p or (isinstance(p[0], int) and not isinstance(p[0], bool)):
            return 1  # a string, or one prompt of token ids (an empty list is refused by prompts())
        return len(p)

    def prompts(self) -> list[dict[str, Any]]:
        """One dict of Engine-style input per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [{"input_ids": list(p)}]
        if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p):
            return [{"input_ids": x} for x in p]
        raise InvalidRequestError("prompt must be a string, a list of strings or token ids", "prompt")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


# "developer" is OpenAI's newer name for "system"; templates know only the latter.
CHAT_ROLES = MappingProxyType({"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                               "tool": "tool"})


class MessageFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call an assistant message made (an earlier turn, sent back by the client)."""

    id: str
    type: str = "function"
    function: MessageFunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def validate(self, i: int) -> None:
        if self.role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {self.role!r}",
                                      "messages")
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise InvalidRequestError(f"messages[{i}]: only assistant messages have tool_calls", "messages")
            for j, call in enumerate(self.tool_calls):
                if call.type != "function":
                    raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].type must be 'function'", "messages")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError(f"messages[{i}]: a tool message needs tool_call_id", "messages")
        content = self.content
        if content is None:
            if self.role != "assistant":
                raise InvalidRequestError(f"messages[{i}].content is required for role {self.role!r}", "messages")
        elif isinstance(content, list):
            if not content:
                raise InvalidRequestError(f"messages[{i}].content must not be an empty list", "messages")
            for j, part in enumerate(content):
                if part.type != "text":
                    raise InvalidRequestError(f"messages[{i}].content[{j}].type {part.type!r} is not supported "
                                              "(only 'text')", "messages")
                if part.text is None:
                    raise InvalidRequestError(f"messages[{i}].content[{j}] has no 'text'", "messages")

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates get it."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        out: dict[str, Any] = {"role": CHAT_ROLES[self.role], "content": content or ""}
        if self.tool_calls is not None:
            out["tool_calls"] = message_tool_calls([msgspec.to_builtins(c) for c in self.tool_calls])
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Common, OpenAITools, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def validate(self) -> None:
        super().validate()
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        for i, m in enumerate(self.messages):
            m.validate(i)
        self.validate_tools()

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.to_sampling(max_tokens, self.logprobs, self.top_logprobs or 0, default_max_tokens)
        return self.constrain_tools(params)

    def prompts(self) -> list[dict[str, Any]]:
        """The one choice's Engine-style input (the chat template is applied at tokenization)."""
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        return [{"messages": [m.as_dict() for m in self.messages], "tools": self.tool_dicts()}]


class TokenizeRequest(msgspec.Struct, OpenAITools, kw_only=True):
    """POST /tokenize (vLLM's shape): a prompt or chat messages (and their tools) -> token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
        for i, m in enumerate(self.messages or []):
            m.validate(i)
        self.validate_tools()

    def prompt_input(self) -> dict[str, Any]:
        if self.messages is not None:
            return {"messages": [m.as_dict() for m in self.messages], "tools": self.tool_dicts()}
        return {"prompt": self.prompt, "tools": self.tool_dicts()}


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize: token ids -> text."""

    model: str | None = None
    tokens: list[int]

    def validate(self) -> None:
        pass


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter body. Unknown fields (vLLM's load_inplace) are ignored."""

    lora_name: str  # the name requests give as `model`
    lora_path: str  # the PEFT adapter folder, under the server's allowed_lora_root
    pinned: bool = False  # never evicted from the engines' host memory (SGLang's `pinned`)

    def validate(self) -> None:
        if not self.lora_name or "=" in self.lora_name:
            raise InvalidRequestError(f"bad adapter name {self.lora_name!r}", "lora_name")
        if not self.lora_path:
            raise InvalidRequestError("lora_path must name the adapter's folder", "lora_path")


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/unload_lora_adapter body (its lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None

    def validate(self) -> None:
        if not self.lora_name:
            raise InvalidRequestError("lora_name must not be empty", "lora_name")
