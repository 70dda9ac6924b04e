"""Structured outputs over real Ray Serve with the `openai` client, on the shared "tiny" app (a
random-weight model with overlap scheduling on, tests/serve/conftest.py): response_format (json_schema, json_object) on both endpoints, SGLang's
regex and ebnf fields, streamed and not, and a 400 naming the parameter for what does not compile."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.serve

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rating": {"enum": [1, 2, 3, 4, 5]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["name", "age"], "additionalProperties": False},
    },
    "required": ["city", "rating", "tags", "owner"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a place as JSON."}]


@pytest.fixture(scope="module")
def base(tiny_app):
    return tiny_app


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def _valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_both_endpoints(client, stream):
    common = dict(model="tiny", max_tokens=500, response_format=RESPONSE_FORMAT, stream=stream)
    comp = client.completions.create(prompt="A place:", temperature=0.0, extra_body={"response_format": RESPONSE_FORMAT},
                                     **{k: v for k, v in common.items() if k != "response_format"})
    chat = client.chat.completions.create(messages=MESSAGES, temperature=1.0, seed=5, n=2, **common)
    if stream:
        comp_text, comp_finish = _gather(comp, chat=False)
        chat_choices = _gather_n(chat, 2)
    else:
        comp_text, comp_finish = comp.choices[0].text, comp.choices[0].finish_reason
        chat_choices = [(c.message.content, c.finish_reason) for c in chat.choices]
    for text, finish in [(comp_text, comp_finish), *chat_choices]:
        assert finish == "stop", text
        _valid(text)


def test_json_object_regex_and_ebnf(client):
    obj = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=2,
                                         response_format={"type": "json_object"})
    choice = obj.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a random model can write a long object: what fits, cut
        assert choice.finish_reason == "length" and choice.message.content.lstrip().startswith("{")
    regex = r"(cat|dog)-[0-9]{2,4}"
    rx = client.completions.create(model="tiny", prompt="pet id:", max_tokens=20, temperature=0.7, seed=1,
                                   extra_body={"regex": regex}, stream=True)
    text, finish = _gather(rx, chat=False)
    assert finish == "stop" and re.fullmatch(regex, text), text
    ebnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z]{1,6}'
    eb = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0.0,
                                        extra_body={"ebnf": ebnf})
    assert eb.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no) because [a-z]{1,6}", eb.choices[0].message.content)


def test_max_tokens_cuts_the_output(client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=0.0,
                                    extra_body={"response_format": RESPONSE_FORMAT})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5
    assert choice.text.startswith("{")  # the truncated (not yet valid) prefix of a conforming output


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": "nope"}}},
     "response_format"),
    ("/v1/completions", {"regex": "([a-z"}, "regex"),
    ("/v1/completions", {"ebnf": "root ::= missing_rule"}, "ebnf"),
    ("/v1/completions", {"regex": "a+", "response_format": {"type": "json_object"}}, "regex"),
])
def test_constraints_that_do_not_compile_get_400(base, path, body, param):
    body = {**body, "model": "tiny", "max_tokens": 4}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES})
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def _gather(stream, chat: bool) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            text.append((c.delta.content or "") if chat else c.text)
            finish = c.finish_reason or finish
    return "".join(text), finish


def _gather_n(stream, n: int) -> list[tuple[str, str | None]]:
    texts, finishes = [[] for _ in range(n)], [None] * n
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index].append(c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes[c.index]
    return [("".join(t), f) for t, f in zip(texts, finishes)]
