"""An adversarial user against real Ray Serve over real HTTP: sampler-hostile values, overflowing
integers, deep nesting, malformed chat, unknown routes, fuzzed bodies, abort storms, streams that
disconnect, slow clients, and a stream whose engine dies after the 200. After each, the engines
still serve and their idle invariant holds. Runs on the shared "tiny" and "slow" apps
(tests/serve/conftest.py: random-weight models, no ../shared)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time

import httpx
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.stats import EngineActorStats
from cluster.cluster import ACTOR_NAMESPACE
from engine.engine import EngineStats
from engine.limits import DEFAULT_LIMITS
from openai_api.protocol import MAX_N
from tests.serve.helpers import engines_of

pytestmark = pytest.mark.serve
LONG = 1000  # max_tokens of a request meant to be cut short (the model's context is 1024)


@pytest.fixture(scope="module")
def app(tiny_app):
    """The shared tiny app and its engines (a test that replaces them updates the list)."""
    return tiny_app, engines_of(tiny_app)


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
             | st.floats() | st.text(max_size=20) | st.sampled_from(["user", "system", "assistant", "text", "tiny"]))
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "include_usage", "x"]) | st.text(max_size=8), c,
    max_size=4), max_leaves=10)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "stop_token_ids", "n", "stream", "stream_options", "logprobs", "top_logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "model", "ignore_eos", "user", "echo",
          "skip_special_tokens", "unknown_field"]
# A valid value of these runs as at most this (the property is about what the server accepts, not
# about long generations); a value past the valid range stays as drawn (a 400).
COSTLY = {"n": (2, MAX_N), "max_tokens": (8, 1024), "max_completion_tokens": (8, 1024)}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=7), chat=st.booleans(),
       fill=st.booleans(), short=st.booleans())
def test_fuzzed_bodies_never_5xx(app, body, chat, fill, short):
    """Any JSON body (NaN and Infinity tokens too, which are not JSON), with or without its prompt
    or messages, gets a response below 500 in the OpenAI error shape, and a stream ends."""
    base, _ = app
    for field, (cap, largest_valid) in COSTLY.items():
        value = body.get(field)
        if type(value) is int and cap < value <= largest_valid:
            body[field] = cap
    if short and "max_tokens" not in body:
        body["max_tokens"] = 3
    if fill and chat and "messages" not in body:
        body["messages"] = [{"role": "user", "content": "hi"}]
    elif fill and not chat and "prompt" not in body:
        body["prompt"] = "hi"
    raw = json.dumps(body)
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


def test_streams_that_disconnect_under_load(slow_app):
    """12 streams that leave after two SSE lines (text or keep-alive) while 4 others keep going:
    each of the 12 is aborted on the engine, and the engine is idle within seconds."""
    import aiohttp

    base, engines = slow_app, engines_of(slow_app)
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


def test_no_engine_gives_503(slow_app):
    """Its engine gone for good, an app answers 503 (no_engine) at once. The slow app's last test:
    it is deleted after it."""
    base = slow_app
    ray.kill(engines_of(base)[0], no_restart=True)
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert httpx.get(f"{base}/health").status_code == 503
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine"


# ---- slow clients ---------------------------------------------------------------------------
def test_dribbling_connections_are_cut(app, serve_base):
    """The session's proxy runs deploy/http_guard with a 2 s header and 3 s body timeout."""
    port = int(serve_base.rsplit(":", 1)[1])
    path = app[0].removeprefix(serve_base).encode() + b"/v1/completions"
    conns = []
    for i in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n" if i % 2 else
                  b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 500\r\n\r\n{\"pro")
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
    # Back when the front end routes again: its health and then a request (the fleet's view of
    # the replaced engines reaches it a moment after they answer health checks).
    deadline = time.monotonic() + 120
    probe = {"prompt": "hello", "max_tokens": 1, "temperature": 0}
    while (httpx.get(f"{base}/health").status_code != 200
           or httpx.post(f"{base}/v1/completions", json=probe, timeout=60).status_code != 200):
        assert time.monotonic() < deadline, "the engines did not come back"
        time.sleep(0.5)
    # Serve replaced the engine replicas: new engines, found by name again.
    names = httpx.get(f"{base}/health").json()["engine_actors"]
    engines[:] = [ray.get_actor(n, namespace=ACTOR_NAMESPACE) for n in names]
    assert_healthy_and_clean(base, engines)


# ---- limits before any work: oversized requests while another client streams -----------------
def frontend_rss(app_name: str) -> int:
    """The private resident memory (RssAnon) in bytes of the app's one front-end replica process:
    its PID from the GCS actor table (what Ray's state API reads; the state API itself needs the
    dashboard, which the tests' Ray does not start), the actor of class
    ServeReplica:<app>:OpenAIServer; the figure from /proc (the test runs on the same machine).
    Not VmRSS: that also counts the pages of Ray's shared object store the replica has touched
    (request bodies travel from Serve's proxy through it), which belong to the store and stay
    mapped after their objects are freed."""
    from ray._private.state import actors as actor_table

    pids = [a["Pid"] for a in actor_table(actor_state_name="ALIVE").values()
            if a["ActorClassName"] == f"ServeReplica:{app_name}:OpenAIServer"]
    assert len(pids) == 1, pids
    with open(f"/proc/{pids[0]}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    return kb * 1024


def chunked_upload(base: str, path: str, total: int, chunk: int = 1 << 16) -> tuple[int, float, int]:
    """POST a JSON-looking body of `total` bytes with Transfer-Encoding: chunked and no
    Content-Length, as fast as the server takes it; stop sending once a response arrives (or the
    server closes). -> (status, seconds to the response, bytes sent)."""
    import select
    from urllib.parse import urlsplit

    url = urlsplit(base)
    s = socket.create_connection((url.hostname, url.port))
    s.sendall(f"POST {url.path}{path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              "transfer-encoding: chunked\r\n\r\n".encode())
    payload = b'{"prompt": "' + b"a" * (chunk - 14) + b'"}'  # JSON-looking, `chunk` bytes
    piece = f"{len(payload):x}\r\n".encode() + payload + b"\r\n"
    t0, sent, data = time.monotonic(), 0, b""
    try:
        while sent < total and time.monotonic() - t0 < 30:
            readable, writable, _ = select.select([s], [s], [], 1)
            if readable:
                break
            if writable:
                s.sendall(piece)
                sent += chunk
        else:
            s.sendall(b"0\r\n\r\n")
    except OSError:  # the server answered and closed while we were sending
        pass
    s.settimeout(10)
    try:
        while b"\r\n" not in data and (more := s.recv(65536)):
            data += more
    except OSError:
        pass
    elapsed = time.monotonic() - t0
    s.close()
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split()[1]), elapsed, sent


def test_oversized_requests_are_refused_at_once_while_another_client_streams(app):
    """Issue 25 section 1: each oversized request is refused (400, or 413 for the body) within a
    second (every one of three tries), naming its limit, before any work: fan-out (prompts x n), a 64 MiB
    chunked body without Content-Length, 300,000 stop ids (eight at once), long stop strings, multi-megabyte
    prompts, and a long prompt under the character limit that must be tokenized (off the event
    loop) to find it does not fit. Meanwhile a stream keeps its longest gap between events under
    1.5 s, the typical normal 32-token request sent during the attacks takes at most 6x its time
    without them and none over 5 s (the stream runs in both; on the suite's shared cores), and the front end's private memory (sampled every
    50 ms) grows by less than 48 MiB while the requests come one at a time (eight 2 MB bodies at
    once: 96 MiB; the chunked body, last: 112 MiB, as Serve's replica fetches a body whatever the app
    reads of it)."""
    import threading

    base, engines = app
    limits = DEFAULT_LIMITS
    stop = threading.Event()
    gaps: list[float] = []
    stream_errors: list[str] = []

    def streamer() -> None:
        body = {"prompt": "a story", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                last = None
                with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.monotonic()
                        if last is not None and line != "data: [DONE]":
                            gaps.append(now - last)
                        last = now
                        if '"error"' in line:
                            stream_errors.append(line)
                        if stop.is_set():
                            break

    def normal(c: httpx.Client) -> float:
        t0 = time.monotonic()
        r = c.post(f"{base}/v1/completions", json={"prompt": "hello there", "max_tokens": 32, "temperature": 0,
                                                   "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32, r.text
        return time.monotonic() - t0

    def raw(body: dict) -> bytes:
        return json.dumps(body).encode()

    attacks = [  # (what, path, body, param, limit)
        ("fan-out prompts", "completions", raw({"prompt": ["a"] * 5000, "n": 64, "max_tokens": 1}), "prompt",
         "max_prompts"),
        ("fan-out choices", "completions", raw({"prompt": ["a"] * 100, "n": 64, "max_tokens": 1}), "n", "max_choices"),
        ("long stop strings", "completions", raw({"prompt": "hi", "stop": ["x" * 200_000] * 16}), "stop",
         "max_stop_str_len"),
        ("many stop strings", "chat/completions", raw({"messages": [{"role": "user", "content": "hi"}],
                                                        "stop": ["x"] * 1000}), "stop", "max_stop_strings"),
        ("multi-megabyte prompt", "completions", raw({"prompt": "a" * 3_000_000}), "prompt", "max_prompt_chars"),
        ("multi-megabyte chat", "chat/completions", raw({"messages": [{"role": "user", "content": "b" * 3_000_000}]}),
         "messages", "max_prompt_chars"),
        ("long prompt to tokenize", "completions", raw({"prompt": "ab " * 13_000, "max_tokens": 8}), "max_tokens",
         None),
    ]
    stop_ids = raw({"prompt": "hi", "max_tokens": 32, "stop_token_ids": list(range(300_000))})

    with httpx.Client(timeout=60) as c:
        for _ in range(2):
            normal(c)  # warm
        rss_before = frontend_rss("tiny")
        thread = threading.Thread(target=streamer, daemon=True)
        thread.start()
        time.sleep(1.0)
        alone = sorted(normal(c) for _ in range(5))[2]  # its typical time alone: the median of five
        phases = ["one at a time", "eight at once", "chunked body"]
        peak = dict.fromkeys(phases, rss_before)
        phase = [phases[0]]  # the current one, set by the attacks below

        def watch_rss() -> None:
            while not stop.is_set():
                peak[phase[0]] = max(peak[phase[0]], frontend_rss("tiny"))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch_rss, daemon=True)
        watcher.start()
        concurrent: list[float] = []
        attacking = threading.Event()

        def normals() -> None:
            with httpx.Client(timeout=60) as c2:
                while attacking.is_set():
                    concurrent.append(normal(c2))

        attacking.set()
        normal_thread = threading.Thread(target=normals, daemon=True)
        normal_thread.start()
        refused: dict[str, list[float]] = {}
        try:
            for _round in range(3):
                for what, path, body, param, limit in attacks:
                    t0 = time.monotonic()
                    r = c.post(f"{base}/v1/{path}", content=body, headers={"content-type": "application/json"})
                    refused.setdefault(what, []).append(time.monotonic() - t0)
                    err = assert_error_shape(r, 400, param)
                    if limit is not None:
                        assert err["code"] == "limit_exceeded" and f"{limit}={getattr(limits, limit)}" in err["message"]
            phase[0] = "eight at once"  # counted apart: what Serve buffered for them stays a while
            for _round in range(3):
                async def eight() -> list[tuple[httpx.Response, float]]:
                    async with httpx.AsyncClient(timeout=60) as ac:
                        async def one() -> tuple[httpx.Response, float]:
                            t0 = time.monotonic()
                            r = await ac.post(f"{base}/v1/completions", content=stop_ids,
                                              headers={"content-type": "application/json"})
                            return r, time.monotonic() - t0
                        return await asyncio.gather(*(one() for _ in range(8)))

                for r, took in asyncio.run(eight()):
                    err = assert_error_shape(r, 400, "stop_token_ids")
                    assert f"max_stop_token_ids={limits.max_stop_token_ids}" in err["message"]
                    refused.setdefault("300,000 stop ids (8 at once)", []).append(took)
            phase[0] = "chunked body"
            for _round in range(3):
                # Serve's proxy drains loopback as fast as it is sent, so on a busy machine the
                # whole body may be out before the answer: the bound is the answer's time (below).
                status, took, sent = chunked_upload(base, "/v1/completions", 64 << 20)
                assert status == 413, (status, sent, took)
                refused.setdefault("64 MiB chunked body", []).append(took)
        finally:
            attacking.clear()
            normal_thread.join(timeout=120)
            stop.set()
            thread.join(timeout=120)
            watcher.join(timeout=10)
    # Each kind is sent three times (eight at once for the stop ids); its slowest try counts: the
    # issue bounds every refusal, not a typical one. Eight 2 MB bodies at once and the 64 MiB
    # body are mostly Serve's proxy moving bytes to the replica, which on 2 shared cores (the
    # suite's other worker busy) can take seconds: their bound here only says nothing waited on
    # work, and the one-second floor is the issue's, for a machine of its own.
    bounds = {"300,000 stop ids (8 at once)": 5.0, "64 MiB chunked body": 5.0}
    times = {what: max(ts) for what, ts in refused.items()}
    slow = {what: round(t, 2) for what, t in times.items() if t >= bounds.get(what, 1.0)}
    assert not slow, f"refused too slowly: {slow} (all: {refused})"
    assert concurrent, "no normal request ran during the attacks"
    # The typical normal request sent during the attacks stays within a few times its time alone
    # and none stalls: on 2 cores the proxy parsing eight 2 MB bodies at once delays whatever
    # request arrives in that instant, and the suite's other worker takes the cores unevenly
    # between the "alone" measurement and the attacks (the 3x and 1.5 s are for a
    # machine of its own).
    typical, slowest = statistics.median(concurrent), max(concurrent)
    assert typical <= 6 * alone and slowest < 5.0, (
        f"normal requests under the attacks took {sorted(concurrent)} s, {alone:.3f}s without them")
    assert gaps and not stream_errors, stream_errors
    assert max(gaps) < 1.5, f"longest gap between a stream's events: {max(gaps):.2f}s"
    growth = {phase: round((p - rss_before) / (1 << 20), 1) for phase, p in peak.items()}
    assert_healthy_and_clean(base, engines)
    assert growth["one at a time"] < 48, f"the front end's private memory grew by {growth} MiB"
    # Eight bodies in the replica at once, each received whole from Serve's proxy whatever the
    # app reads of it: a bound of its own, scaled to the bodies held together.
    assert growth["eight at once"] < 96, f"the front end's private memory grew by {growth} MiB"
    # Serve's replica keeps fetching a request's body from the proxy until the connection ends,
    # whatever the app reads: up to the whole 64 MiB on a busy machine, on top of the budget.
    assert growth["chunked body"] < 64 + 48, f"the front end's private memory grew by {growth} MiB"


def test_a_long_prompt_is_tokenized_off_the_event_loop(app):
    """A prompt under the character limit but long to tokenize (1,000,000 characters, over the
    context) does not stall a stream on the same front end: the stream's longest gap between
    events while it is tokenized stays well under the time its refusal takes (on the event loop,
    the gap would be about all of it)."""
    import threading

    base, engines = app
    body = json.dumps({"prompt": "ab " * 333_333 + "a", "max_tokens": 8}).encode()
    events: list[float] = []
    started, done = threading.Event(), threading.Event()

    def streamer() -> None:  # streams one after another until the long prompt is answered
        req = {"prompt": "a story", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c:
            while not done.is_set():
                with c.stream("POST", f"{base}/v1/completions", json=req) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            events.append(time.monotonic())
                            started.set()

    thread = threading.Thread(target=streamer, daemon=True)
    thread.start()
    assert started.wait(60)
    time.sleep(0.5)
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120)
    t1 = time.monotonic()
    done.set()
    assert_error_shape(r, 400, "max_tokens")  # tokenized, then over the context
    thread.join(timeout=120)
    during = [b - a for a, b in zip(events, events[1:]) if b > t0 and a < t1]
    assert during, "the stream sent nothing while the long prompt was tokenized"
    assert max(during) < 0.5 * (t1 - t0), (max(during), t1 - t0)
    assert max(during) < 1.5
    assert_healthy_and_clean(base, engines)
