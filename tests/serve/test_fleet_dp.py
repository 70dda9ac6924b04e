"""An attention-DP group in the fleet: a Serve gang (its own module: the apps of test_fleet.py
hold the test Ray's CPUs until that module ends), answering plain and constrained requests on
the trained stories260K model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
import ray

from deploy.app import build_app
from tests.serve.helpers import engines_of, wait_for_engines

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "mood": {"enum": ["happy", "sad"]},
                                           "friends": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}, "maxItems": 3}},
          "required": ["name", "mood", "friends"], "additionalProperties": False}


@pytest.fixture(scope="module")
def dp_base(serve_base, model_dirs):
    from ray import serve

    path = model_dirs["stories"]
    serve.run(build_app({"model_path": path, "num_engines": 2, "dp_attention": True, "dp_group_size": 2,
                         "served_model_name": "stories"}), name="fleet-dp", route_prefix="/fleet-dp")
    base = serve_base + "/fleet-dp"
    try:
        wait_for_engines(base, 2)
        yield base, path
    finally:  # without waiting: the gang stops (each engine drains first) while the next tests run
        serve.delete("fleet-dp", _blocking=False)


def test_an_attention_dp_group_is_a_serve_gang(dp_base):
    """dp_attention in the fleet: the group's two engines are one Serve gang, step together
    (IDLE batches for the member with no request) and answer as one engine would."""
    from engine import Engine, SamplingParams

    base, path = dp_base
    ref = Engine(model_path=path).generate(prompt="Once upon a time",
                                           sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0))
    for _ in range(3):
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
    stats = ray.get([e.stats.remote() for e in engines_of(base)])
    assert all(s.dp is not None and s.dp.steps > 0 for s in stats)  # both stepped in lock-step
    assert any(s.engine.batches_by_mode["IDLE"] > 0 for s in stats)


def test_structured_outputs_on_the_trained_model_under_attention_dp(dp_base):
    """JSON schema (streamed and not, sampled, several choices) and regex outputs conform on
    stories260K, whose text pulls away from the grammar, with the requests spread over the group."""
    base, _ = dp_base
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "kid", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Lily was happy."}]
    chat = client.chat.completions.create(model="stories", messages=messages, max_tokens=200, temperature=0.8,
                                          seed=3, n=3, response_format=fmt)
    texts = [(c.message.content, c.finish_reason) for c in chat.choices]
    stream = client.chat.completions.create(model="stories", messages=messages, max_tokens=200, temperature=0.0,
                                            response_format=fmt, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    texts.append(("".join(parts), finish))
    for text, finish in texts:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    regex = r"(Tom|Sue) is [0-9]{1,2}\."
    rx = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=20, temperature=0.9,
                                   seed=7, n=2, extra_body={"regex": regex})
    for c in rx.choices:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text


def asleep(coord, engines: list) -> None:
    """Until every member has run every wave its coordinator announced and has no request: the
    group sleeps, so the next request needs a new wave."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(ray.exceptions.RayActorError):  # the coordinator restarting
            waves = ray.get(coord.stats.remote()).waves_started
            stats = ray.get([e.stats.remote() for e in engines])
            if not any(s.dp.waves < waves or s.engine.running or s.engine.waiting for s in stats):
                return
        assert time.monotonic() < deadline, "the group did not go to sleep"
        time.sleep(0.05)


def test_the_group_survives_its_coordinator_restarting(dp_base):
    """Ray restarts the gang's DPCoordinator while a stream runs: the stream ends normally, the
    members check back in, and later requests (each needing a new wave) are answered; none
    waits for the request timeout."""
    from deploy.engines import ACTOR_NAMESPACE

    base, _ = dp_base
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == ACTOR_NAMESPACE and a["name"].startswith("radixray-dp-")]
    assert len(names) == 1, names
    coord = ray.get_actor(names[0], namespace=ACTOR_NAMESPACE)
    before = ray.get(coord.stats.remote())
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def stream_through_the_restart() -> list[str]:
        async with httpx.AsyncClient(timeout=90) as client, client.stream(
                "POST", f"{base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            else:
                pytest.fail("the stream ended before its first event")
            ray.kill(coord, no_restart=False)
            return [line async for line in lines if line]

    # httpx's timeout bounds each read; the whole stream gets 90 s.
    rest = asyncio.run(asyncio.wait_for(stream_through_the_restart(), 90))
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest).replace(" ", "")
    for _ in range(3):  # the group sleeps between these: each needs a wave from the new coordinator
        asleep(coord, engines_of(base))
        r = httpx.post(f"{base}/v1/completions", timeout=90,
                       json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
    after = ray.get(coord.stats.remote())
    assert after.coordinator != before.coordinator and after.rejoins == 2 and after.members == [0, 1], after
