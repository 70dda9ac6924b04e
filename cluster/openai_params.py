"""The OpenAI-named sampling fields and their one mapping to SamplingParams (the HTTP bodies and
the batch job's input lines both extend this struct)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine import InvalidRequestError, SamplingParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object


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
            regex=self.regex, ebnf=self.ebnf)
