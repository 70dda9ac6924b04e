"""Tool-call parsers on text (no model): whole outputs, and streamed in pieces of every size,
which must add up to what the whole parse gives. Also the tool fields' schema and validation."""

from __future__ import annotations

import json
import typing

import jsonschema
import msgspec
import pytest

from deploy.options import HTTPOptions
from engine import InvalidRequestError
from openai_api.params import OpenAISampling
from openai_api.protocol import ChatCompletionRequest
from openai_api.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    StreamParts,
    ToolParser,
    parser_for,
)

HERMES = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}{<tool_call>", '
          '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"arguments": {"x": {"y": null}}, "name": "f"}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "n": -1.5e3}}; {"name": "f", "parameters": {}}'
ARRAY = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "f", "arguments": {"a": [1, "]"]}}]'


def streamed(parser: ToolParser, text: str, step: int) -> tuple[StreamParts, bool]:
    s = parser.stream()
    parts = StreamParts()
    for i in range(0, len(text), step):
        parts.add(s.feed(text[i:i + step]))
    parts.add(s.finish())
    return parts, s.called


def calls_of(parts: StreamParts) -> list[tuple[str, str]]:
    """(name, arguments) per call, checking the OpenAI delta order: id and name first, then fragments."""
    calls: dict[int, list[str]] = {}
    for d in parts.tool_calls:
        if d.index not in calls:
            assert d.id is not None and d.id.startswith("call_") and d.name and d.arguments == ""
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
            calls[d.index][1] += d.arguments
    assert list(calls) == list(range(len(calls)))
    return [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("parser,text,content,expected", [
    (HermesToolParser(), HERMES, "Let me look.",
     [("get_weather", '{"city": "Paris \\"}{<tool_call>", "days": [1, 2]}'), ("f", '{"x": {"y": null}}')]),
    (Llama3JsonToolParser(), LLAMA, None,
     [("get_weather", '{"city": "Oslo", "n": -1.5e3}'), ("f", "{}")]),
    (Llama3JsonToolParser(), '{"name":"f","parameters":{"a":1},"extra":true}', None, [("f", '{"a":1}')]),
    (JsonArrayToolParser(), ARRAY, None, [("get_weather", '{"city": "Rome"}'), ("f", '{"a": [1, "]"]}')]),
])
def test_calls_whole_and_streamed(parser, text, content, expected):
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    assert all(c.id.startswith("call_") and c.as_openai()["type"] == "function" for c in parsed.tool_calls)
    for step in (1, 2, 5, 17, len(text)):
        parts, called = streamed(parser, text, step)
        assert called and calls_of(parts) == expected, step
        assert (parts.content.strip() or None) == content


@pytest.mark.parametrize("parser,text", [
    (HermesToolParser(), "Just text, with a < and <tool_ in it"),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut by max_tokens
    (HermesToolParser(), "<tool_call>not json</tool_call> bye"),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": 3}</tool_call>'),  # arguments not an object
    (Llama3JsonToolParser(), 'Sure: {"name": "f", "parameters": {}}'),  # not at the start: content
    (Llama3JsonToolParser(), '{"answer": 42}'),  # JSON, but no call
    (Llama3JsonToolParser(), "  "),
    (JsonArrayToolParser(), '[{"name": "f", "arguments": {"a": "x'),
    (JsonArrayToolParser(), '[\n{ "na'),  # cut before the name
    (HermesToolParser(), 'Hi <tool_call>{"na'),
])
def test_text_that_is_no_complete_call_is_content(parser, text):
    parsed = parser.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_stream_holds_back_only_what_may_start_a_tag():
    s = HermesToolParser().stream()
    assert s.feed("Hello <tool").content == "Hello "
    assert s.feed("box> and more").content == "<toolbox> and more"
    assert s.finish().content == ""
    s = Llama3JsonToolParser().stream()
    assert s.feed("  <|py").content == ""  # may be the python tag
    assert s.feed("thon is fun").content == "  <|python is fun"
    assert not s.called


def test_arguments_given_as_a_json_string_are_decoded():
    text = '{"name": "f", "parameters": "{\\"a\\": 1}"}'
    assert [(c.name, c.arguments) for c in Llama3JsonToolParser().parse(text).tool_calls] == [("f", '{"a": 1}')]
    assert calls_of(streamed(Llama3JsonToolParser(), text, 3)[0]) == [("f", '{"a": 1}')]


def test_parser_flag_choices_are_the_registry():
    field = next(f for f in msgspec.structs.fields(HTTPOptions) if f.name == "tool_call_parser")
    literal = next(a for a in typing.get_args(field.type) if a is not type(None))
    assert set(typing.get_args(literal)) == set(TOOL_PARSERS)
    assert isinstance(parser_for("auto", "hermes"), HermesToolParser)
    assert isinstance(parser_for("named", None), JsonArrayToolParser)
    assert parser_for("none", "hermes") is None
    with pytest.raises(InvalidRequestError) as e:
        parser_for("auto", None)
    assert e.value.param == "tool_choice"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "now"}}


def _chat(**body) -> ChatCompletionRequest:
    req = msgspec.json.decode(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}),
                              type=ChatCompletionRequest)
    req.validate()
    return req


def test_required_and_named_constrain_to_the_call_array():
    req = _chat(tools=[WEATHER, NOARGS], tool_choice="required")
    schema = json.loads(req.sampling(16).json_schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "now", "arguments": {"x": 1}}],
                [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = json.loads(_chat(tools=[WEATHER, NOARGS], tool_choice={"type": "function", "function": {
        "name": "now"}}).sampling(16).json_schema)
    jsonschema.validate([{"name": "now", "arguments": {}}], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}] * 2, named)  # one call
    assert _chat(tools=[WEATHER]).tool_mode == "auto" and _chat(tools=[WEATHER]).sampling(16).json_schema is None
    assert _chat(tools=[WEATHER], tool_choice="none").sampling(16).json_schema is None
    single = json.loads(_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).sampling(16).json_schema)
    assert single["maxItems"] == 1


@pytest.mark.parametrize("body,param", [
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"prompt_logprobs": 3, "stream": True}, "prompt_logprobs"),
])
def test_bad_tool_fields(body, param):
    from engine.errors import invalid_request_from

    with pytest.raises((InvalidRequestError, msgspec.ValidationError)) as e:
        _chat(**body).sampling(16)
    err = e.value if isinstance(e.value, InvalidRequestError) else invalid_request_from(e.value)
    assert err.param == param, err


def test_prompt_logprobs_maps_to_sampling_params():
    assert msgspec.convert({"prompt_logprobs": 2}, OpenAISampling).sampling_params(8).prompt_logprobs == 2
    with pytest.raises(InvalidRequestError) as e:
        msgspec.convert({"prompt_logprobs": 21}, OpenAISampling).sampling_params(8)
    assert e.value.param == "prompt_logprobs"


# ---- JSON nested deeper than `json` goes: no call, never an exception --------------------------
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("parser,text", [
    (HermesToolParser(), 'ok <tool_call>{"name": "f", "arguments": {"a": ' + DEEP + '}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": ' + DEEP + ', "arguments": {}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": "' + DEEP.replace("]", "") + '"}</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": ' + DEEP + '}}'),
    (JsonArrayToolParser(), '[{"name": "f", "arguments": {"a": ' + DEEP + '}}]'),
    (JsonArrayToolParser(), '[{"name": ' + DEEP + ', "arguments": {}}]'),
], ids=["hermes-args", "hermes-name", "hermes-string-args", "llama3-args", "array-args", "array-name"])
def test_deeply_nested_arguments_are_text_not_a_failure(parser, text):
    """json.loads raises RecursionError on such output (a client can force it with regex or ebnf
    under tool_choice auto): the whole parse gives no call, the stream never raises."""
    parsed = parser.parse(text)
    assert parsed.tool_calls == [] and parsed.content
    if "arguments\": {\"a\"" in text or "parameters\": {\"a\"" in text:
        assert parsed.content == text  # a call whose arguments do not parse: all of it is content
    for step in (len(text), 4096):
        streamed(parser, text, step)  # does not raise


def test_deep_arguments_in_a_batch_output_become_text_and_sent_back_ones_stay_text():
    from cluster.batch import result_row
    from engine.engine import StreamDelta
    from openai_api.params import message_tool_calls

    text = '[{"name": "f", "arguments": {"a": ' + DEEP + '}}]'
    delta = StreamDelta(rid="r", text=text, token_ids=[1], finish_reason="stop", prompt_tokens=2,
                        completion_tokens=1)
    row = result_row("row-1", [delta], [1, 2], parser=JsonArrayToolParser())
    assert row.error is None and row.tool_calls is None and row.text == text and row.finish_reason == "stop"
    args = '{"a": ' + DEEP + '}'  # a client sends such a call back in an assistant message
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    assert message_tool_calls([call])[0]["function"]["arguments"] == args
