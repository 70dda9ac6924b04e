"""Tool calling, echo and prompt logprobs over real Ray Serve with the `openai` client, on a
random-weight model whose chat template renders tools (Qwen-style) and tool turns: the shared
"tiny" app of tests/serve/conftest.py (hermes parser, overlap scheduling); the second parser
(llama3_json) is the shared "slow" app's (the bench's random-weight model, its plain template).

A random model rarely writes a tool call on its own: tool_choice "required" and named are
constrained (always valid), and "auto" is driven to a call with SGLang's `regex` field so each
parser is exercised end to end; the parsers on plain text are tests/cluster/test_tool_parsers.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.serve

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def literal(text: str) -> str:
    """A regex matching exactly text (every non-alphanumeric character as a hex escape)."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):02x}}}" for c in text)


@pytest.fixture(scope="module")
def apps(tiny_app, slow_app):
    """The shared app of each parser."""
    return {"hermes": tiny_app, "llama3_json": slow_app}


def client_for(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(tiny_app):
    return client_for(tiny_app)


def gather_calls(chunks) -> tuple[dict[int, dict], str, str | None]:
    """Streamed tool calls by index ({id, name, arguments}), the content, the finish_reason; checks
    OpenAI's order: a call's first delta has its id, type and name, later ones only arguments."""
    calls: dict[int, dict] = {}
    content, finish = [], None
    for chunk in chunks:
        for c in chunk.choices:
            content.append(c.delta.content or "")
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
                else:
                    assert tc.id is None and not tc.function.name
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, "".join(content), finish


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_are_valid(client, choice, stream):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                         max_tokens=300, temperature=0.8, seed=4, stream=stream,
                                         parallel_tool_calls=False)
    if stream:
        calls, content, finish = gather_calls(out)
        calls = [calls[i] for i in sorted(calls)]
        assert content == ""
    else:
        msg = out.choices[0].message
        finish, content = out.choices[0].finish_reason, msg.content
        assert content is None
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
        assert all(c.type == "function" and c.id.startswith("call_") for c in msg.tool_calls)
    assert finish == "tool_calls" and len(calls) == 1
    if choice == "named":
        assert calls[0]["name"] == "get_time"
    check_call(calls[0]["name"], calls[0]["arguments"])


def test_calls_cut_by_max_tokens(client):
    """Cut before the call array closes: no tool_calls, finish_reason "length", and the array
    written so far as content (streamed: the call deltas sent so far)."""
    body = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=40, temperature=0)
    out = client.chat.completions.create(**body)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.lstrip().startswith("[")
    calls, content, finish = gather_calls(client.chat.completions.create(**body, stream=True))
    assert finish == "length" and content == ""
    assert all(c["name"] in PARAMS for c in calls.values())


def test_round_trip_through_the_template(client, tiny_app):
    """A call, its result sent back as a tool message, and the answer; the template renders the
    tools, the assistant's call (content null) and the tool turn."""
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    args = check_call("get_weather", call.function.arguments)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content is not None
    base = tiny_app
    ids = httpx.post(f"{base}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60).json()["tokens"]
    rendered = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert json.dumps(TOOLS[0]) in rendered  # the tools, as transformers' tojson writes them
    assert f'{{"name": "get_weather", "arguments": {json.dumps(args, ensure_ascii=False)}}}' in rendered
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in rendered
    assert answer.usage.prompt_tokens == len(ids)


CITY = '{"name": "get_weather", "arguments": {"city": "'
CALL_END = '", "unit": "c"}}'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_auto_parses_calls_out_of_the_text(apps, parser, stream):
    """tool_choice auto: the server's parser turns the model's own call format into tool_calls
    (the output is driven there by a regex; the text before a hermes call stays content)."""
    if parser == "hermes":
        pattern = literal("Checking.<tool_call>\n" + CITY) + "[a-z]{1,6}" + literal(CALL_END + "\n</tool_call>")
    else:
        pattern = literal(CITY.replace('"arguments"', '"parameters"')) + "[a-z]{1,6}" + literal(CALL_END)
    out = client_for(apps[parser]).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0.5, seed=1, stream=stream,
        extra_body={"regex": pattern})
    if stream:
        calls, content, finish = gather_calls(out)
        calls = list(calls.values())
    else:
        msg = out.choices[0].message
        finish, content = out.choices[0].finish_reason, msg.content
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    assert check_call("get_weather", calls[0]["arguments"])["unit"] == "c"
    assert (content or None) == ("Checking." if parser == "hermes" else None)


def test_auto_without_a_call_is_content(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("length", "stop") and not choice.message.tool_calls
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert choice.message.content == plain.choices[0].message.content  # the same text, unparsed


PROMPT = "the quick brown fox"


def test_echo(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert "".join(lp.tokens[1:n_prompt]) == PROMPT and lp.tokens[0] == "<s>"  # BOS first
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for tok, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == value and 2 <= len(top) <= 3  # the top 2 and the token itself
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_prompt_logprobs(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, n=2, logprobs=1,
                                    echo=True, extra_body={"prompt_logprobs": 3})
    ids = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    echoed = out.choices[0].logprobs.token_logprobs
    for choice in out.choices:  # computed once, by the first choice; the second hits the cache
        plp = choice.model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for pos, entry in enumerate(plp[1:], 1):
            mine = entry[str(ids[pos])]
            assert mine["logprob"] == pytest.approx(echoed[pos]) and mine["decoded_token"] == PROMPT[pos - 1]
            ranks = sorted(v["rank"] for v in entry.values())  # the top 3, and the token if it is not
            assert ranks[:3] == [1, 2, 3] and len(entry) in (3, 4) and mine["rank"] >= 1
    assert out.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and all(len(e) == 1 for e in plp[1:])


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_values_get_400_naming_the_parameter(tiny_app, body, param):
    r = httpx.post(tiny_app + "/v1/chat/completions",
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
