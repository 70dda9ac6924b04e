"""An adversarial user against real Ray Serve over real HTTP: sampler-hostile values, overflowing
integers, deep nesting, malformed chat, unknown routes, fuzzed bodies, abort storms, streams that
disconnect, slow clients, and a stream whose engine dies after the 200. After each, the engines
still serve and their idle invariant holds. Runs on a random-weight model (no ../shared)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.stats import EngineActorStats
from cluster.cluster import ACTOR_NAMESPACE
from deploy.app import build_app
from engine.engine import EngineStats

pytestmark = pytest.mark.serve
LONG = 1000  # max_tokens of a request meant to be cut short (the model's context is 1024)


@pytest.fixture(scope="module")
def app(serve_base, model_dirs):
    from ray import serve

    serve.run(build_app({"model_path": model_dirs["llama"], "num_engines": 2, "served_model_name": "tiny"}),
              name="hostile", route_prefix="/hostile")
    base = serve_base + "/hostile"
    names = httpx.get(f"{base}/health").json()["engine_actors"]
    yield base, [ray.get_actor(n, namespace=ACTOR_NAMESPACE) for n in names]
    serve.delete("hostile")


def engine_stats(engines) -> list[EngineActorStats]:
    return ray.get([e.stats.remote() for e in engines], timeout=30)


def assert_healthy_and_clean(base: str, engines) -> list[EngineStats]:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert httpx.get(f"{base}/health").status_code == 200
    return ray.get([e.check_memory.remote() for e in engines], timeout=120)


def metric(base: str, status: str) -> int:
    text = httpx.get(f"{base}/metrics").text
    return int(next(line for line in text.splitlines()
                    if line.startswith(f'radixray_requests_total{{status="{status}",')).split()[-1])


def assert_error_shape(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- the payloads that killed engines --------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"top_k": 9223372036854775808}, "top_k"),
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": 100_000}, "top_k"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"seed": 10**30, "top_k": 10**30}, "top_k"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"temperature": 1e308, "top_p": 1e308}, "top_p"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_sampling_values_get_400(app, body, param, stream):
    base, engines = app
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "stream": stream, **body},
                   timeout=60)
    assert_error_shape(r, 400, param)
    assert_healthy_and_clean(base, engines)


@pytest.mark.parametrize("body", [{"temperature": 1e-40}, {"temperature": 1e-300}, {"seed": 10**30},
                                  {"seed": -5, "temperature": 0.8}, {"temperature": 1e300}])
def test_values_the_sampler_normalises_generate(app, body):
    base, engines = app
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "ignore_eos": True,
                                                   **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    if body.get("temperature", 1) < 1e-5:  # normalised to greedy
        greedy = httpx.post(f"{base}/v1/completions", json={"prompt": "hello world", "max_tokens": 8,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert_healthy_and_clean(base, engines)


@pytest.mark.parametrize("where", ["prompt", "unknown"])
def test_deep_nesting_gets_400(app, where):
    base, _ = app
    deep = "[" * 10_000 + "]" * 10_000
    raw = ('{"prompt": ' + deep + ', "max_tokens": 2}' if where == "prompt"
           else '{"prompt": "x", "max_tokens": 2, "extra": ' + deep + "}")
    r = httpx.post(f"{base}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error_shape(r, 400)
    r = httpx.post(f"{base}/v1/chat/completions", content=raw.replace('"prompt"', '"messages"'),
                   headers={"content-type": "application/json"})
    assert_error_shape(r, 400)


@pytest.mark.parametrize("messages", [
    [{"role": "wizard", "content": "hi"}],
    [{"role": "", "content": "hi"}],
    [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user"}],
    [],
])
def test_malformed_chat_gets_400(app, messages):
    base, _ = app
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert_error_shape(r, 400, "messages")


def test_chat_roles_and_parts_that_are_fine(app):
    base, engines = app
    r = httpx.post(f"{base}/v1/chat/completions", json={"max_tokens": 3, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text
    assert_healthy_and_clean(base, engines)


def test_unknown_routes_and_methods_use_the_openai_shape(app):
    base, _ = app
    assert assert_error_shape(httpx.get(f"{base}/v1/nothing"), 404)["code"] == "not_found"
    assert assert_error_shape(httpx.get(f"{base}/v1/completions"), 405)["code"] == "method_not_allowed"
    assert assert_error_shape(httpx.delete(f"{base}/v1/models"), 405)["code"] == "method_not_allowed"


# ---- fuzzing: never a 5xx, never a hang ------------------------------------------------------
json_leaf = (st.none() | st.booleans() | st.integers() | st.integers(2**63 - 2, 2**70) | st.integers(-2**70, -2**63)
             | st.floats() | st.text(max_size=12) | st.sampled_from(["user", "system", "assistant", "text", "tiny"]))
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "include_usage", "x"]) | st.text(max_size=6), c,
    max_size=4), max_leaves=10)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "stop_token_ids", "n", "stream", "stream_options", "logprobs", "top_logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "model", "ignore_eos", "user", "echo",
          "skip_special_tokens", "unknown_field"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=7), chat=st.booleans(),
       short=st.booleans())
def test_fuzzed_bodies_never_5xx(app, body, chat, short):
    base, _ = app
    if short and "max_tokens" not in body:
        body["max_tokens"] = 3
    if chat and "messages" not in body:
        body["messages"] = [{"role": "user", "content": "hi"}]
    elif not chat and "prompt" not in body:
        body["prompt"] = "hi"
    raw = json.dumps(body)  # NaN and Infinity tokens too (not JSON: a 400)
    r = httpx.post(f"{base}/v1/{'chat/' if chat else ''}completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code < 500, (r.status_code, r.text[:300], raw[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")


def test_after_fuzzing_engines_are_healthy_and_idle(app):
    base, engines = app
    stats = assert_healthy_and_clean(base, engines)
    assert all(s.running == 0 and s.waiting == 0 and s.kv_used == 0 for s in stats)


# ---- aborts that always happen ---------------------------------------------------------------
def wait_idle(engines, within_s: float) -> list[EngineActorStats]:
    """Poll until no request is queued or running; fail if it takes longer than within_s."""
    deadline = time.monotonic() + within_s
    while True:
        stats = engine_stats(engines)
        if all(s.engine.running == 0 and s.engine.waiting == 0 for s in stats):
            return stats
        assert time.monotonic() < deadline, f"requests still running {within_s}s after the cancels: {stats}"
        time.sleep(0.1)


def test_abort_storm_of_client_timeouts(app):
    """Many non-streaming requests whose clients give up once they are on the engines (or after
    10 s at most): every one that reached an engine is aborted there (none runs to max_tokens),
    KV returns to idle within seconds, and the server counts every handler it started as aborted."""
    base, engines = app
    n = 40
    before, aborted_before = engine_stats(engines), metric(base, "aborted")

    def reached() -> int:
        return sum(a.engine.num_received - b.engine.num_received for a, b in zip(engine_stats(engines), before))

    async def one(client: httpx.AsyncClient, i: int) -> None:
        await client.post(f"{base}/v1/completions", json={"prompt": f"story {i}", "max_tokens": LONG,
                                                           "temperature": 0, "ignore_eos": True})

    async def storm() -> list:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(reached) < n // 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for t in tasks:  # the clients give up: their connections close mid-request
                t.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(storm())
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
    after = wait_idle(engines, within_s=10)
    aborted = sum(a.engine.num_aborted - b.engine.num_aborted for a, b in zip(after, before))
    received = sum(a.engine.num_received - b.engine.num_received for a, b in zip(after, before))
    generated = sum(a.engine.generated_tokens - b.engine.generated_tokens for a, b in zip(after, before))
    assert received >= n // 2, f"only {received} of {n} requests reached an engine in 10 s"
    assert aborted == received, f"{received - aborted} of {received} cancelled requests ran on"
    assert generated < received * LONG // 2
    deadline = time.monotonic() + 30  # the server's own count can lag the engines' (a loaded CI machine)
    while metric(base, "aborted") - aborted_before < received and time.monotonic() < deadline:
        time.sleep(0.1)
    counted = {status: metric(base, status) for status in ("aborted", "ok", "error")}
    assert received <= counted["aborted"] - aborted_before <= n, (received, aborted_before, counted)
    assert_healthy_and_clean(base, engines)


@pytest.fixture(scope="module")
def slow_app(app, serve_base):
    """One engine on the bench's 50M-parameter model: a 1000-token request takes many seconds, so
    a stream that leaves early cannot have finished on its own (the tiny model could)."""
    from ray import serve

    from engine.bench import bench_model_path

    serve.run(build_app({"model_path": bench_model_path(), "num_engines": 1, "torch_threads_per_engine": 1}),
              name="hostile-slow", route_prefix="/hostile-slow")
    base = serve_base + "/hostile-slow"
    names = httpx.get(f"{base}/health").json()["engine_actors"]
    yield base, [ray.get_actor(n, namespace=ACTOR_NAMESPACE) for n in names]
    serve.delete("hostile-slow")


def test_streams_that_disconnect_under_load(slow_app):
    """12 streams that leave after two SSE lines (text or keep-alive) while 4 others keep going:
    each of the 12 is aborted on the engine, and the engine is idle within seconds."""
    import aiohttp

    base, engines = slow_app
    before = engine_stats(engines)

    async def stream(session: aiohttp.ClientSession, i: int, leave: bool) -> str | None:
        body = {"prompt": f"tale {i}", "max_tokens": LONG if leave else 8, "temperature": 0,
                "ignore_eos": True, "stream": True}
        lines, finish = 0, None
        async with session.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if not line:
                    continue
                lines += 1
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                if leave and lines >= 2:
                    assert finish is None, "a long request finished before its client left"
                    r.close()  # the client goes away mid-stream
                    return None
        return finish

    async def run() -> list[str | None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(stream(session, i, i < 12) for i in range(16)))

    finishes = asyncio.run(run())
    assert finishes == [None] * 12 + ["length"] * 4
    after = wait_idle(engines, within_s=10)
    aborted = sum(a.engine.num_aborted - b.engine.num_aborted for a, b in zip(after, before))
    generated = sum(a.engine.generated_tokens - b.engine.generated_tokens for a, b in zip(after, before))
    assert aborted == 12 and generated < 12 * LONG // 2, (aborted, generated, before, after)
    assert_healthy_and_clean(base, engines)


# ---- slow clients ---------------------------------------------------------------------------
def test_dribbling_connections_are_cut(app, serve_base):
    """The session's proxy runs deploy/http_guard with a 2 s header and 3 s body timeout."""
    port = int(serve_base.rsplit(":", 1)[1])
    conns = []
    for i in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /hostile/v1/completions HTTP/1.1\r\nhost: x\r\n" if i % 2 else
                  b"POST /hostile/v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 500\r\n\r\n{\"pro")
        conns.append(s)
    t0 = time.monotonic()
    for s in conns:
        s.settimeout(max(0.1, 10 - (time.monotonic() - t0)))
        data = b""
        try:
            while chunk := s.recv(4096):
                data += chunk
        except TimeoutError:
            pytest.fail("a dribbling connection was still open after 10 s")
        assert data.startswith(b"HTTP/1.1 408"), data[:100]
        s.close()
    assert time.monotonic() - t0 < 10


# ---- a stream that fails after its 200 -------------------------------------------------------
def test_stream_whose_engines_die_ends_with_an_error_and_a_finish_reason(app):
    base, engines = app
    body = {"prompt": "a long one", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    done = False
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    for e in engines:  # whichever engine has it; Ray restarts both
                        ray.kill(e, no_restart=False)
    assert done, "the stream did not end with [DONE]"
    errors = [i for i, e in enumerate(events) if "error" in e]
    assert errors, "no error event after the engine died"
    assert events[errors[0]]["error"]["code"] == "engine_error"
    final = events[errors[0] + 1]
    assert final["choices"][0]["finish_reason"] == "abort"
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engines did not come back"
        time.sleep(0.5)
    # Serve replaced the engine replicas: new engines, found by name again.
    names = httpx.get(f"{base}/health").json()["engine_actors"]
    engines[:] = [ray.get_actor(n, namespace=ACTOR_NAMESPACE) for n in names]
    assert_healthy_and_clean(base, engines)
