"""The OpenAI-named sampling fields and their one mapping to SamplingParams (the HTTP bodies and
the batch job's input lines both extend this struct)."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from engine import InvalidRequestError, SamplingParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object
DEFAULT_MAX_TOKENS = 256  # max_tokens of a request (HTTP body or batch row) that sets none


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    """response_format.json_schema: OpenAI's structured-output schema (`strict` or not, the output
    always matches it)."""

    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JSONSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must match (a string), or None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.type != "json_schema":
            raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                      f"got {self.type!r}", "response_format")
        if self.json_schema is None or self.json_schema.schema is None:
            raise InvalidRequestError("response_format of type 'json_schema' needs json_schema.schema",
                                      "response_format")
        return msgspec.json.encode(self.json_schema.schema).decode()


class OpenAISampling(msgspec.Struct, kw_only=True):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    min_tokens: int = 0
    # Structured outputs: OpenAI's response_format, or SGLang's regex / ebnf (at most one).
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprob, rank and top-k of each prompt token
    # vLLM's request priority (lower = more important, default 0): not a sampling parameter, the
    # front end hands it to the engine with the request (Engine.submit's `priority`), where the
    # `priority` eviction policy keeps important requests' prefixes longest.
    priority: int = 0

    def sampling_params(self, default_max_tokens: int, max_tokens: int | None = None, logprobs: bool = False,
                        top_logprobs: int = 0) -> SamplingParams:
        """max_tokens overrides the field (chat's max_completion_tokens); raises InvalidRequestError."""
        max_tokens = max_tokens if max_tokens is not None else self.max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            bias = tuple((int(k), v) for k, v in (self.logit_bias or {}).items())
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None
        return SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, logprobs=logprobs,
            top_logprobs=top_logprobs, skip_special_tokens=self.skip_special_tokens, logit_bias=bias,
            min_tokens=self.min_tokens,
            json_schema=self.response_format.schema_text() if self.response_format is not None else None,
            regex=self.regex, ebnf=self.ebnf, prompt_logprobs=self.prompt_logprobs)


# ---- tool calling ----------------------------------------------------------------------------
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")


class ToolFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: ToolFunction


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: ToolChoiceFunction


class OpenAITools:
    """The methods of `tools` and `tool_choice` on a chat request (the HTTP body, /tokenize, the
    batch job's lines). A mixin (msgspec structs take one base with fields): each struct declares

        tools: list[Tool] | None = None
        tool_choice: str | NamedToolChoice | None = None
        parallel_tool_calls: bool = True

    With "required" or a named function the output is constrained to the JSON array of calls
    `[{"name": ..., "arguments": {...}}, ...]` (one call when named or parallel_tool_calls is
    false) whose arguments match each tool's parameters schema; the server turns that array into
    tool_calls (openai_api.tool_parsers.JsonArrayToolParser), whatever parser serves "auto"."""

    __slots__ = ()
    tools: list[Tool] | None
    tool_choice: str | NamedToolChoice | None
    parallel_tool_calls: bool

    def validate_tools(self) -> None:
        """Raises InvalidRequestError naming `tools` or `tool_choice`."""
        if self.tools is not None:
            if not self.tools:
                raise InvalidRequestError("tools must not be empty (leave it out instead)", "tools")
            seen: set[str] = set()
            for i, tool in enumerate(self.tools):
                if tool.type != "function":
                    raise InvalidRequestError(f"tools[{i}].type must be 'function', got {tool.type!r}", "tools")
                name = tool.function.name
                if not TOOL_NAME.fullmatch(name):
                    raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', "
                                              f"got {name!r}", "tools")
                if name in seen:
                    raise InvalidRequestError(f"tools[{i}]: a second function named {name!r}", "tools")
                seen.add(name)
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named function, "
                                      f"got {choice!r}", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.type != "function":
                raise InvalidRequestError(f"tool_choice.type must be 'function', got {choice.type!r}", "tool_choice")
            if not any(t.function.name == choice.function.name for t in self.tools or ()):
                raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not "
                                          "among the tools", "tool_choice")
        if choice is not None and choice != "none" and self.tools is None:
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (tool_choice's default: "auto" with tools)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (OpenAI's shape), None without tools."""
        return None if self.tools is None else [msgspec.to_builtins(t) for t in self.tools]

    def tool_schema(self) -> str | None:
        """The JSON schema the output must match for "required" or a named function, else None."""
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return None
        tools = [t for t in self.tools or () if mode == "required" or t.function.name == self.tool_choice.function.name]
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            # Left out, a function takes no arguments (OpenAI): an empty object.
            "arguments": t.function.parameters if t.function.parameters is not None else {
                "type": "object", "properties": {}, "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if mode == "named" or not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def constrain_tools(self, params: SamplingParams) -> SamplingParams:
        """params with the tool-call constraint of "required" or a named function, if any."""
        schema = self.tool_schema()
        if schema is None:
            return params
        if params.constraint is not None:
            raise InvalidRequestError(f"tool_choice {self.tool_mode!r} cannot be combined with response_format, "
                                      "regex or ebnf", "tool_choice")
        return msgspec.structs.replace(params, json_schema=schema)


def message_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates expect them: arguments as an object
    (templates write `arguments | tojson`), as vLLM and transformers pass them."""
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):  # not an object the template can take: left as text
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        out.append({**call, "function": fn})
    return out
