"""The request limits outside the engine (engine/limits.py): one config section with flat names
(CLI, YAML, Serve args), the batch job's lines, the counts the HTTP bodies give before they are
built, and how a streamed response ends when something other than the client fails it."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from cluster.batch import BatchLine, build_parser, parse_row
from cluster.cli import cluster_config
from cluster.config import ClusterConfig
from engine.errors import ConfigError
from engine.limits import DEFAULT_LIMITS, LimitExceededError, RequestLimits
from openai_api.protocol import ChatCompletionRequest, CompletionRequest


def test_limits_come_flat_or_nested_and_reach_every_engine():
    cfg = ClusterConfig.from_kwargs(strict=False, max_body_bytes="1000", limits={"max_prompts": 7})
    assert cfg.limits == RequestLimits(max_body_bytes=1000, max_prompts=7)
    assert cfg.engine_config().limits == cfg.limits  # the engines check the same stop-list limits
    args = build_parser().parse_args(["--input", "i", "--output", "o", "--max-stop-token-ids", "9",
                                      "--max-prompt-chars", "100"])
    cfg = cluster_config(args, *args.config_fields)
    assert (cfg.limits.max_stop_token_ids, cfg.limits.max_prompt_chars) == (9, 100)
    assert cfg.limits.max_choices == DEFAULT_LIMITS.max_choices
    with pytest.raises(ConfigError):
        ClusterConfig.from_kwargs(max_choices=0)
    with pytest.raises(ConfigError):
        ClusterConfig.from_kwargs(engine={"limits": {"max_prompts": 3}})  # set on the cluster


def test_app_args_take_the_limits_flat():
    from deploy.options import AppArgs, HTTPOptions

    args = AppArgs.from_dict({"max_body_bytes": "65536", "max_choices": 10, "served_model_name": "m"})
    assert args.cluster.limits.max_body_bytes == 65536 and args.cluster.limits.max_choices == 10
    assert "max_body_bytes" not in HTTPOptions.__struct_fields__  # one place for the limits
    assert AppArgs.from_dict({"limits": {"max_prompts": 3}}).cluster.limits.max_prompts == 3


@pytest.mark.parametrize("value", [0, -1, "0", float("nan"), float("inf")])
def test_metrics_refresh_must_be_positive(value):
    from deploy.options import AppArgs

    with pytest.raises(ConfigError, match="metrics_refresh_s"):
        AppArgs.from_dict({"metrics_refresh_s": value})
    assert AppArgs.from_dict({"metrics_refresh_s": "0.25"}).http.metrics_refresh_s == 0.25


@pytest.mark.parametrize("body,count", [
    ({"prompt": "a"}, 1), ({"prompt": [1, 2, 3]}, 1), ({"prompt": ["a"] * 5}, 5), ({"prompt": [[1], [2]]}, 2),
])
def test_prompts_are_counted_before_they_are_built(body, count):
    req = msgspec.convert(body, CompletionRequest)
    assert req.num_prompts() == count == len(req.prompts())
    chat = msgspec.convert({"messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    assert chat.num_prompts() == 1


def test_fan_out_limits_name_the_limit_and_its_value():
    limits = RequestLimits()
    limits.check_choices(2048, 1)
    limits.check_choices(16, 128)
    with pytest.raises(LimitExceededError) as err:
        limits.check_choices(5000, 1)
    assert err.value.param == "prompt" and "max_prompts=2048" in str(err.value)
    with pytest.raises(LimitExceededError) as err:
        limits.check_choices(17, 128)
    assert err.value.param == "n" and "max_choices=2048" in str(err.value)


# ---- the batch job's lines ------------------------------------------------------------------------
def test_a_line_over_the_body_limit_is_an_error_row_unparsed():
    limits = RequestLimits(max_body_bytes=100)
    rid, line, err = parse_row(json.dumps({"id": "a", "prompt": "x" * 200}), "f:1", "radixray-builtin", limits=limits)
    assert (rid, line) == ("f:1", None) and "max_body_bytes=100" in err
    rid, line, err = parse_row(json.dumps({"id": "a", "prompt": "é" * 40}), "f:2", "radixray-builtin", limits=limits)
    assert line is None and "max_body_bytes=100" in err  # 80 characters, more than 100 bytes
    rid, line, err = parse_row(json.dumps({"id": "a", "prompt": "x" * 50}), "f:3", "radixray-builtin", limits=limits)
    assert err is None and isinstance(line, BatchLine)


def test_a_deeply_nested_line_is_an_error_row():
    raw = '{"id": "a", "prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    rid, line, err = parse_row(raw, "f:1", "radixray-builtin")
    assert line is None and "nested too deeply" in err


@pytest.mark.parametrize("fields,limit", [
    ({"stop_token_ids": list(range(300_000))}, "max_stop_token_ids"),
    ({"stop": ["x" * 200_000]}, "max_stop_str_len"),
    ({"stop": ["x"] * 17}, "max_stop_strings"),
])
def test_stop_lists_over_the_limits_are_error_rows(fields, limit):
    rid, line, err = parse_row(json.dumps({"id": "a", "prompt": "x", **fields}), "f:1", "radixray-builtin")
    assert rid == "a" and line is None and f"{limit}=" in err


def test_a_chat_over_the_message_limit_is_an_error_row():
    chat = [{"role": "user", "content": "hi"}] * 5
    rid, line, err = parse_row(json.dumps({"id": "a", "messages": chat}), "f:1", "radixray-builtin",
                               limits=RequestLimits(max_messages=4))
    assert rid == "a" and line is None and "max_messages=4" in err
    rid, line, err = parse_row(json.dumps({"id": "a", "messages": chat}), "f:1", "radixray-builtin",
                               limits=RequestLimits(max_messages=5))
    assert err is None


def test_a_grammar_over_the_limit_is_an_error_row():
    raw = json.dumps({"id": "a", "prompt": "x", "regex": "a" * 9})
    rid, line, err = parse_row(raw, "f:1", "radixray-builtin", limits=RequestLimits(max_grammar_chars=8))
    assert rid == "a" and line is None and "max_grammar_chars=8" in err
    assert parse_row(raw, "f:1", "radixray-builtin", limits=RequestLimits(max_grammar_chars=9))[2] is None


# A template that walks a tool's parameters recursively, as real ones render nested schemas.
WALKING_TEMPLATE = (
    "{% macro walk(v) %}{% if v is mapping %}{% for k in v %}{{ k }}{{ walk(v[k]) }}{% endfor %}{% endif %}"
    "{% endmacro %}{% for t in tools or [] %}{{ walk(t) }}{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def _inputs(tmp_path, template: str):
    from engine.builtin_model import byte_level_tokenizer
    from engine.inputs import InputProcessor
    from engine.tokenizer import Tokenizer

    tok = byte_level_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "chat_template": template}))
    tokenizer = Tokenizer(str(tmp_path))
    return InputProcessor(tokenizer, tokenizer.vocab_size, 4096, 8192)


def test_a_chat_template_that_fails_makes_an_error_row_not_a_failed_window(tmp_path):
    from cluster.batch import tokenize_rows

    inputs = _inputs(tmp_path, WALKING_TEMPLATE)
    deep: dict = {}
    for _ in range(400):  # parses (json.loads takes it), but the template's recursion does not
        deep = {"p": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    chat = [{"role": "user", "content": "hi"}]
    rows = [json.dumps({"id": "deep", "messages": chat, "tools": [tool], "tool_choice": "none", "max_tokens": 4}),
            json.dumps({"id": "ok", "messages": chat, "max_tokens": 4})]
    parsed = [parse_row(raw, f"f:{i}", "radixray-builtin") for i, raw in enumerate(rows)]
    assert all(err is None for _, _, err in parsed)
    failed, work = tokenize_rows(parsed, inputs)
    assert failed == [("deep", "request nested too deeply")]
    assert [w[1] for w in work] == ["ok"] and work[0][0]  # the other row of the window still runs

    raising = _inputs(tmp_path, "{{ raise_exception('no system role') }}")
    failed, work = tokenize_rows(parsed[1:], raising)
    assert work == [] and failed[0][0] == "ok" and "no system role" in failed[0][1]


# ---- a stream that fails for a reason other than its client ---------------------------------------
def _server():
    """The front end's class without Serve: only what _sse reads."""
    from deploy.app import OpenAIServer
    from deploy.metrics import ServerMetrics

    server = object.__new__(OpenAIServer.func_or_class)
    server.metrics, server.encoder, server.model_name = ServerMetrics(), msgspec.json.Encoder(), "m"
    return server


async def _events(server, failure: BaseException) -> list[bytes]:
    from engine.engine import StreamDelta
    from openai_api.outputs import RequestOutput

    async def merged(rid, choices, watch, priority=0):  # the first token, then a failure (injected)
        yield 0, StreamDelta(rid="r-0", text="hi", token_ids=[1], prompt_tokens=1, completion_tokens=1)
        raise failure

    server._merged = merged
    req = msgspec.convert({"prompt": "x", "stream": True}, CompletionRequest)
    out = RequestOutput(str, False, 1, [([1], "")])
    return [e async for e in server._sse(req, "cmpl-1", [([1], None)], out, None)]


def test_a_stream_that_fails_counts_an_error_and_ends_with_an_error_event_and_done():
    server = _server()
    events = asyncio.run(_events(server, RuntimeError("boom")))
    assert events[-1] == b"data: [DONE]\n\n"
    error = json.loads(events[-2][len(b"data: "):])["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "boom" not in error["message"] and "cmpl-1" in error["message"]  # the request id, not internals
    assert json.loads(events[0][len(b"data: "):])["choices"][0]["text"] == "hi"
    assert server.metrics.requests["error"] == 1 and server.metrics.requests["aborted"] == 0


def test_a_cancelled_stream_counts_as_aborted():
    server = _server()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_events(server, asyncio.CancelledError()))
    assert server.metrics.requests["aborted"] == 1 and server.metrics.requests["error"] == 0


def test_short_inputs_tokenize_inline_while_long_ones_hold_the_pool():
    """A short request does not queue behind long ones that hold every tokenizer thread."""
    import concurrent.futures
    import threading

    from engine.tokenizer import LONG_TEXT_CHARS

    server = _server()
    server.tokenize_pool = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()

    async def run() -> None:
        loop_thread = threading.get_ident()
        long = asyncio.create_task(server._tokenizing(LONG_TEXT_CHARS, lambda: (release.wait(30), threading.get_ident())))
        await asyncio.sleep(0)  # the long one takes the pool's only thread
        short = await asyncio.wait_for(server._tokenizing(LONG_TEXT_CHARS - 1, threading.get_ident), 10)
        assert short == loop_thread and not long.done()
        release.set()
        assert (await long)[1] != loop_thread

    try:
        asyncio.run(run())
    finally:
        release.set()
        server.tokenize_pool.shutdown()
