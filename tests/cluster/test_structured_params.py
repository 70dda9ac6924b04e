"""The OpenAI structured-output fields map onto SamplingParams the same way for HTTP bodies and
batch lines (both extend OpenAISampling)."""

from __future__ import annotations

import json

import msgspec
import pytest

from cluster.batch import BatchLine
from engine import InvalidRequestError
from openai_api.params import JSON_OBJECT_SCHEMA, OpenAISampling

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def _params(body: dict, struct: type = OpenAISampling):
    return msgspec.json.decode(json.dumps(body), type=struct).sampling_params(16)


def test_response_format_regex_and_ebnf_map_to_sampling_params():
    p = _params({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                           "strict": True}}})
    assert p.constraint == ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))  # property order kept
    assert _params({"response_format": {"type": "json_object"}}).json_schema == JSON_OBJECT_SCHEMA
    assert _params({"response_format": {"type": "text"}}).constraint is None
    assert _params({"regex": "[a-z]+"}).constraint == ("regex", "[a-z]+")
    assert _params({"ebnf": 'root ::= "a"'}).constraint == ("ebnf", 'root ::= "a"')
    line = _params({"id": 1, "prompt": "x", "response_format": {"type": "json_object"}}, BatchLine)  # batch job
    assert line.json_schema == JSON_OBJECT_SCHEMA


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"regex": ""}, "regex"),
])
def test_bad_structured_fields(body, param):
    with pytest.raises(InvalidRequestError) as e:
        _params(body)
    assert e.value.param == param
