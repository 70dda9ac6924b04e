"""The request limits the engine itself enforces (engine/limits.py): stop lists and prompt
characters, refused before anything is queued or tokenized, for direct Engine users too, with
the limit and its value in the error."""

from __future__ import annotations

import msgspec
import pytest

from engine import Engine, InvalidRequestError, SamplingParams
from engine.errors import ConfigError
from engine.flags import field_docs
from engine.limits import DEFAULT_LIMITS, LimitExceededError, RequestLimits, count_chars
from engine.req import Req

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(model_dirs):
    return Engine(model_path=model_dirs["llama"], max_total_tokens=512)


def refused(err: pytest.ExceptionInfo, limit: str, param: str) -> None:
    e = err.value
    assert isinstance(e, LimitExceededError) and e.limit == limit and e.param == param, e
    assert f"{limit}={getattr(DEFAULT_LIMITS, limit)}" in str(e)  # the limit and its value
    assert e.code == "limit_exceeded"


def test_defaults_are_at_least_openais_and_every_field_has_a_help_line():
    d = DEFAULT_LIMITS
    assert d.max_stop_strings >= 4 and d.max_prompts >= 2048 and d.max_choices >= 2048
    assert d.max_prompt_chars >= 1 << 20 and d.max_body_bytes >= 4 << 20
    docs = field_docs(RequestLimits)
    assert set(docs) == set(RequestLimits.__struct_fields__), docs
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError):
            RequestLimits(max_prompts=bad)


@pytest.mark.parametrize("params,limit,param", [
    ({"stop_token_ids": list(range(DEFAULT_LIMITS.max_stop_token_ids + 1))}, "max_stop_token_ids", "stop_token_ids"),
    ({"stop": [f"s{i}" for i in range(DEFAULT_LIMITS.max_stop_strings + 1)]}, "max_stop_strings", "stop"),
    ({"stop": ["x" * (DEFAULT_LIMITS.max_stop_str_len + 1)]}, "max_stop_str_len", "stop"),
])
def test_stop_lists_over_the_limits_are_refused_by_the_engine(engine, params, limit, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(PROMPT, SamplingParams(max_new_tokens=4, **params), lambda d: None)
    refused(err, limit, param)
    with pytest.raises(InvalidRequestError) as err:  # the dict form too (msgspec-decoded)
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, **params})
    refused(err, limit, param)
    engine.check_memory()


def test_stop_lists_at_the_limits_run(engine):
    vocab = engine.model_config.vocab_size
    ids = [t for t in range(vocab) if t not in engine.eos_ids][:min(DEFAULT_LIMITS.max_stop_token_ids, vocab - 2)]
    ids = ids[len(ids) // 2:]  # half the vocabulary: the output may or may not hit one
    params = SamplingParams(max_new_tokens=6, temperature=0, stop=["q" * DEFAULT_LIMITS.max_stop_str_len] *
                            DEFAULT_LIMITS.max_stop_strings, stop_token_ids=ids)
    out = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert out.error is None and out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in params.stop_token_ids
    engine.check_memory()


def test_stop_token_ids_are_a_frozenset_on_every_path():
    """The per-token stop check is a set lookup, whatever the caller passed."""
    for p in (SamplingParams(stop_token_ids=[3, 1, 3]), SamplingParams(stop_token_ids=(1, 3)),
              msgspec.convert({"stop_token_ids": [3, 1]}, SamplingParams),
              msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(stop_token_ids=[1, 3])),
                                     type=SamplingParams)):
        assert isinstance(p.stop_token_ids, frozenset) and p.stop_token_ids == {1, 3}
    req = Req("r", [1, 2], SamplingParams(stop_token_ids=range(1000, 1_001_000)))
    req.output_ids = [500_000]
    req.check_finished(frozenset(), 10**9)
    assert req.finished_reason.kind == "stop" and req.finished_reason.matched == 500_000
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(stop_token_ids=[1, True])
    assert err.value.param == "stop_token_ids"


def test_the_limits_come_from_the_engine_config(model_dirs):
    """A direct Engine user sets them (EngineConfig.limits); below the defaults here."""
    eng = Engine(model_path=model_dirs["llama"], max_total_tokens=256,
                 limits=RequestLimits(max_stop_token_ids=4, max_prompt_chars=32))
    with pytest.raises(InvalidRequestError) as err:
        eng.submit(PROMPT, SamplingParams(max_new_tokens=2, stop_token_ids=[1, 2, 3, 4, 5]), lambda d: None)
    assert err.value.limit == "max_stop_token_ids" and "max_stop_token_ids=4" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        eng.generate("x" * 33, {"max_new_tokens": 2})
    assert err.value.limit == "max_prompt_chars" and err.value.param == "prompt"
    out = eng.generate("x" * 32, {"max_new_tokens": 2})
    assert out.error is None
    eng.check_memory()


def test_prompt_characters_are_checked_before_tokenization(engine):
    inputs = engine.inputs
    over = DEFAULT_LIMITS.max_prompt_chars + 1
    with pytest.raises(InvalidRequestError) as err:
        inputs.tokenize(prompt="a" * over)
    refused(err, "max_prompt_chars", "prompt")
    with pytest.raises(InvalidRequestError) as err:  # a chat: its messages' characters together
        inputs.tokenize(messages=[{"role": "user", "content": "a" * (over // 2)},
                                  {"role": "user", "content": "b" * (over // 2 + 1)}])
    refused(err, "max_prompt_chars", "messages")
    with pytest.raises(InvalidRequestError) as err:  # tool definitions count too
        inputs.tokenize(messages=[{"role": "user", "content": "hi"}],
                        tools=[{"type": "function", "function": {"name": "f", "description": "d" * over}}])
    refused(err, "max_prompt_chars", "messages")
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("a" * over, {"max_new_tokens": 2})
    refused(err, "max_prompt_chars", "prompt")


def test_count_chars_walks_deep_values_without_recursion():
    deep: object = "abc"
    for _ in range(100_000):
        deep = [deep, {"k": "d"}]
    assert count_chars(deep) == 3 + 100_000 * 2


def test_messages_over_the_limit_are_refused_before_they_are_rendered(engine):
    limits = RequestLimits(max_messages=3)
    limits.check_messages(3)
    with pytest.raises(LimitExceededError) as err:
        limits.check_messages(4)
    assert err.value.limit == "max_messages" and err.value.param == "messages" and "max_messages=3" in str(err.value)
    chat = [{"role": "user", "content": "hi"}] * (DEFAULT_LIMITS.max_messages + 1)
    with pytest.raises(InvalidRequestError) as err:
        engine.inputs.tokenize(messages=chat)
    refused(err, "max_messages", "messages")
    assert engine.inputs.tokenize(messages=chat[:DEFAULT_LIMITS.max_messages])


@pytest.mark.parametrize("field,param", [("regex", "regex"), ("ebnf", "ebnf"), ("json_schema", "response_format")])
def test_structured_output_specs_over_the_limit_are_refused_before_they_compile(engine, field, param):
    over = "a" * (DEFAULT_LIMITS.max_grammar_chars + 1)
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(PROMPT, SamplingParams(max_new_tokens=2, **{field: over}), lambda d: None)
    refused(err, "max_grammar_chars", param)
    limits = RequestLimits(max_grammar_chars=8)
    limits.check_grammar(None)
    limits.check_grammar((field, "a" * 8))
    with pytest.raises(LimitExceededError) as err:
        limits.check_grammar((field, "a" * 9))
    assert err.value.param == param and "max_grammar_chars=8" in str(err.value)
    engine.check_memory()
