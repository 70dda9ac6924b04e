"""What a row is: an input line (`BatchLine`, checked by `parse_row`) and the work row Preprocess
hands the engines (`WORK_SCHEMA`); a result row is the writer's (`shards.ResultRow`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pyarrow as pa

from engine.errors import InvalidRequestError
from engine.limits import DEFAULT_LIMITS, RequestLimits
from engine.sampling import SamplingParams
from openai_api.params import DEFAULT_MAX_TOKENS, NamedToolChoice, OpenAISampling, OpenAITools, Tool
from openai_api.tool_parsers import parser_for


class BatchLine(OpenAISampling, OpenAITools, kw_only=True, forbid_unknown_fields=True):
    """One input row."""

    id: str | int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    model: str | None = None  # optional, as in OpenAI requests; the model being run, or one of its LoRA adapters
    tools: list[Tool] | None = None  # with messages, as in chat completions
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # with a prompt: the text starts with it

    def params(self) -> SamplingParams:
        """Its SamplingParams (tool_choice "required" or named constrains the output); raises
        InvalidRequestError."""
        self.validate_tools()
        if self.tools is not None and self.messages is None:
            raise InvalidRequestError("tools need messages", "tools")
        if self.echo and self.prompt is None:
            raise InvalidRequestError("echo needs a prompt", "echo")
        return self.constrain_tools(self.sampling_params(DEFAULT_MAX_TOKENS))


# echo: the text the output starts with; tool_parser: what parses its tool calls (None: plain text);
# lora_name: the LoRA adapter it runs under (None: the base model).
WORK_SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("params", pa.binary()),
                         ("error", pa.string()), ("echo", pa.string()), ("tool_parser", pa.string()),
                         ("lora_name", pa.string())])


def lora_name_of(line: BatchLine, model_name: str) -> str | None:
    """The LoRA adapter a row's `model` names (None: the base model; parse_row checked it)."""
    return None if line.model is None or line.model == model_name else line.model


def parse_row(raw: str, src: str, model_name: str, tool_call_parser: str | None = None,
              limits: RequestLimits = DEFAULT_LIMITS,
              adapters: frozenset[str] = frozenset()) -> tuple[str, BatchLine | None, str | None]:
    """-> (id, parsed row or None, error or None). A row with no usable id is named by src.
    `tool_call_parser`: the job's, for rows with tool_choice "auto". `adapters`: the LoRA adapters
    the engines load (lora_paths), which a row's `model` may name. A line over
    limits.max_body_bytes is not parsed; the message count and the stop lists are checked before
    they are copied."""
    limit = limits.max_body_bytes
    if len(raw) > limit or (4 * len(raw) > limit and len(raw.encode("utf-8", "surrogatepass")) > limit):
        return src, None, f"a line over {limit} bytes (limit max_body_bytes={limit})"
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return src, None, f"invalid JSON: {e}"
    except RecursionError:
        return src, None, "invalid JSON: nested too deeply"
    rid = src
    if isinstance(obj, dict) and isinstance(obj.get("id"), str | int) and not isinstance(obj.get("id"), bool):
        rid = str(obj["id"])
    try:
        line = msgspec.convert(obj, BatchLine)
    except msgspec.ValidationError as e:
        return rid, None, f"invalid fields: {e}"
    if (line.prompt is None) == (line.messages is None):
        return rid, None, "give exactly one of prompt or messages"
    if line.model is not None and line.model != model_name and line.model not in adapters:
        return rid, None, f"model {line.model!r} does not exist (running {model_name!r} and its LoRA adapters)"
    try:
        if line.messages is not None:
            limits.check_messages(len(line.messages))
        limits.check_stops(line.stop, line.stop_token_ids)
        limits.check_grammar(line.params().constraint)
        parser_for(line.tool_mode, tool_call_parser)
    except InvalidRequestError as e:
        return rid, None, str(e)
    return rid, line, None
