"""More of the OpenAI surface over real Ray Serve with the `openai` client: n > 1 sharing one
prefill, logit_bias, min_tokens, continuous usage stats, /tokenize and /detokenize, and a 400
naming the parameter for each bad value. Runs on the shared "tiny" app (tests/serve/conftest.py: a
random-weight model, no ../shared)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import ray

from actors.protocol import decode_kv_snapshot
from engine.token_trie import common_prefix_len
from tests.serve.helpers import engines_of

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def surface(tiny_app):
    return tiny_app


@pytest.fixture(scope="module")
def client(surface):
    return openai.OpenAI(base_url=surface + "/v1", api_key="none", max_retries=0)


PROMPT = "the quick brown fox jumps over the lazy dog, again and again"


def cached_prefix(engine, ids: list[int]) -> int:
    """How many leading tokens of ids the engine's radix cache holds now."""
    snapshot = decode_kv_snapshot(ray.get(engine.kv_snapshot.remote()))
    return max((common_prefix_len(path, ids) for path in snapshot.paths), default=0)


def test_n_choices_share_one_prefill(client, surface):
    engines = engines_of(surface)
    prompt = f"{uuid.uuid4().hex} {PROMPT}"  # new to the shared app's caches
    ids = httpx.post(f"{surface}/tokenize", json={"prompt": prompt}).json()["tokens"]
    held = [cached_prefix(e, ids) for e in engines]  # what earlier tests left (the BOS token, say)
    before = [s.engine for s in ray.get([e.stats.remote() for e in engines])]
    # ignore_eos: the prompt is new each run, and a sampled EOS would end a choice early.
    out = client.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=8, temperature=0.8, seed=7,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1  # each choice has its own seed stream
    after = [s.engine for s in ray.get([e.stats.remote() for e in engines])]
    prompt_len = out.usage.prompt_tokens
    assert prompt_len == len(ids)
    # All four choices went to one engine (the one whose cache the first choice fills).
    received = [a.num_received - b.num_received for a, b in zip(after, before)]
    assert sorted(received) == [0] * (len(engines) - 1) + [4], received
    e = received.index(4)
    assert after[e].prompt_tokens - before[e].prompt_tokens == 4 * prompt_len
    # The prompt is computed once: the first choice finds what the cache held before, the other
    # three find all but its last token.
    assert after[e].cached_tokens - before[e].cached_tokens == min(held[e], prompt_len - 1) + 3 * (prompt_len - 1)
    assert out.usage.completion_tokens == 32 and out.usage.prompt_tokens_details.cached_tokens == prompt_len - 1
    again = client.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=8, temperature=0.8, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]

    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                                 max_tokens=5, temperature=0, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1, 2]


def test_logit_bias_forces_and_bans(client):
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    tokenize = httpx.post(f"{client.base_url}".replace("/v1/", "") + "/tokenize", json={"prompt": first}).json()
    first_id = tokenize["tokens"][-1]
    banned = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                       logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                       logit_bias={"65": 100})
    piece = httpx.post(f"{client.base_url}".replace("/v1/", "") + "/detokenize", json={"tokens": [65]}).json()
    assert forced.choices[0].text == piece["prompt"] * 5


def test_min_tokens_holds_back_stop_tokens(client):
    body = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, logit_bias={"65": 100})
    plain = client.completions.create(**body, extra_body={"stop_token_ids": [65]})
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    held = client.completions.create(**body, extra_body={"stop_token_ids": [65], "min_tokens": 5})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))
    usages = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert usages and usages == sorted(usages) and usages[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6


def test_tokenize_detokenize_round_trip(surface):
    base = surface
    tok = httpx.post(f"{base}/tokenize", json={"prompt": "hello there"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("hello there")
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 2, "prompt_logprobs": 30}, "prompt_logprobs"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_bad_values_get_400_naming_the_parameter(surface, path, body, param):
    r = httpx.post(surface + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
