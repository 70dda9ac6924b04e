"""Streaming cost: a stream's tokens coalesced per stream interval (the first token and the end
never held), over HTTP and in Cluster.stream_ids itself; the streaming counters on /metrics. (`cluster serve
--ingress direct` is tested with the CLI, in test_cli.py.)"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types

import httpx
import pytest

from cluster import Cluster, ClusterConfig
from cluster.channels import Channels
from engine import SamplingParams, StreamDelta
from tests.serve.helpers import API_KEY

pytestmark = pytest.mark.serve


# ---- Cluster.stream_ids, with a fake engine (no Ray) -------------------------------------------
class _FakeRouter:
    disaggregated = False

    def pick(self, input_ids, cost, exclude=frozenset(), pool=None, lora_name=None):
        return 0

    def done(self, idx, cost, input_ids, lora_name=None):
        pass


def _fake_cluster(interval_s: float) -> Cluster:
    """Just what stream_ids touches: one engine whose submit succeeds, deliveries by hand."""
    async def submit(payload, consumer):
        return "incarnation"

    cl = Cluster.__new__(Cluster)
    cl.config = ClusterConfig(stream_interval_s=interval_s)
    cl._lock = threading.Lock()
    cl.channels = Channels(cl._lock)
    cl.router = _FakeRouter()
    cl.consumer = "test"
    cl.engines = [types.SimpleNamespace(actor=types.SimpleNamespace(submit=types.SimpleNamespace(remote=submit)))]
    return cl


def _delta(i: int, finish: str | None = None) -> StreamDelta:
    return StreamDelta(rid="r", text=f"<{i}>", token_ids=[i], finish_reason=finish, prompt_tokens=3,
                       completion_tokens=i)


async def _stream(cl: Cluster, feed) -> list[tuple[float, StreamDelta]]:
    """Run stream_ids while `feed(deliver)` delivers deltas; (seconds since start, delta) each."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got: list[tuple[float, StreamDelta]] = []

    async def read() -> None:
        async for d in cl.stream_ids([1, 2, 3], SamplingParams(max_new_tokens=8), "r"):
            got.append((loop.time() - t0, d))

    reader = asyncio.create_task(read())
    while cl.channels.engine_of("r") is None:
        if reader.done():  # it failed before subscribing: its error, not a hang
            reader.result()
            raise AssertionError("stream_ids ended before subscribing")
        await asyncio.sleep(0.001)
    await feed(lambda d: cl.channels.deliver_batch([d], 0))
    await asyncio.wait_for(reader, timeout=30)
    return got


def test_first_token_and_end_are_never_held():
    """A long interval: the first token goes out alone at once; the tokens after it are held
    and merged; the end arrives well before the interval is over and takes them with it."""
    async def feed(deliver) -> None:
        deliver(_delta(1))
        await asyncio.sleep(0.05)
        for i in (2, 3, 4):
            deliver(_delta(i))
            await asyncio.sleep(0.01)
        deliver(_delta(5, "length"))

    got = asyncio.run(_stream(_fake_cluster(1.0), feed))
    assert [d.token_ids for _, d in got] == [[1], [2, 3, 4, 5]]
    assert got[1][1].text == "<2><3><4><5>" and got[1][1].finish_reason == "length"
    assert got[1][1].completion_tokens == 5  # the counts are the last delta's
    assert got[0][0] < 0.5 and got[1][0] < 0.8, "the first token or the end waited for the interval"


def test_held_tokens_go_out_after_the_interval():
    async def feed(deliver) -> None:
        deliver(_delta(1))
        await asyncio.sleep(0.02)
        deliver(_delta(2))
        deliver(_delta(3))
        await asyncio.sleep(0.6)  # two intervals: the held tokens must have gone out alone
        deliver(_delta(4, "stop"))

    got = asyncio.run(_stream(_fake_cluster(0.25), feed))
    assert [d.token_ids for _, d in got] == [[1], [2, 3], [4]]
    assert 0.2 <= got[1][0] - got[0][0] < 0.55  # one interval after the first token (a loaded box is late)


def test_zero_interval_sends_every_delta():
    async def feed(deliver) -> None:
        for i in (1, 2, 3):
            deliver(_delta(i))
            await asyncio.sleep(0.01)
        deliver(_delta(4, "stop"))

    got = asyncio.run(_stream(_fake_cluster(0.0), feed))
    assert [d.token_ids for _, d in got] == [[1], [2], [3], [4]]


# ---- over HTTP ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coalescing(stories_app):
    """The shared stories app: the longest stream interval (1 s), so every stream's tokens after
    its first are merged into few events."""
    return stories_app


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _events(url: str, body: dict) -> tuple[list[bytes], float]:
    """The raw SSE events of one streamed request, and how long it took."""
    t0 = time.monotonic()
    with httpx.Client(timeout=120, headers=AUTH) as c, c.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_bytes())
    return [e for e in raw.split(b"\n\n") if e], time.monotonic() - t0


def _chunks(events: list[bytes]) -> list[dict]:
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


def test_events_carry_several_tokens_and_the_first_goes_alone(coalescing):
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events, _ = _events(f"{coalescing}/v1/completions", body)
    chunks = [c for c in _chunks(events) if c["choices"]]
    counts, seen = [], 0
    for c in chunks:
        counts.append(c["usage"]["completion_tokens"] - seen)
        seen = c["usage"]["completion_tokens"]
    assert seen == 48 and sum(counts) == 48
    assert counts[0] == 1, f"the first token was held back: {counts}"
    assert max(counts) > 1 and len(chunks) < 48, f"no tokens were coalesced: {counts}"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    full = httpx.post(f"{coalescing}/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"},
                      headers=AUTH, timeout=120).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_chat_stream_coalesced_equals_nonstream(coalescing):
    body = {"messages": [{"role": "user", "content": "Tell me about a dog."}], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    events, _ = _events(f"{coalescing}/v1/chat/completions", body)
    chunks = _chunks(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    full = httpx.post(f"{coalescing}/v1/chat/completions", json=body, headers=AUTH, timeout=120).json()
    assert text == full["choices"][0]["message"]["content"]
    assert len(chunks) < 40 and events[-1] == b"data: [DONE]"


def test_metrics_count_events_tokens_and_cpu(coalescing):
    """The streaming counters (one front end: its replica label on each); nothing on the page
    depends on when it was last read, so a second scrape between the two changes nothing."""
    def values() -> dict[str, float]:
        text = httpx.get(f"{coalescing}/metrics", timeout=60).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith(("radixray_sse_", "radixray_streamed_", "radixray_frontend_cpu")):
                assert name.count("{replica=") == 1, line
                out[name.split("{")[0]] = float(value)
        return out

    before = values()
    body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    events, _ = _events(f"{coalescing}/v1/completions", body)
    middle, after = values(), values()
    assert after["radixray_streamed_tokens_total"] - before["radixray_streamed_tokens_total"] == 32
    assert after["radixray_sse_events_total"] - before["radixray_sse_events_total"] == len(events)
    assert after["radixray_frontend_cpu_seconds_total"] > before["radixray_frontend_cpu_seconds_total"]
    # No per-token gauge of a window since the previous scrape: PromQL's rate(a) / rate(b) replaces it.
    assert set(after) == {"radixray_sse_events_total", "radixray_streamed_tokens_total",
                          "radixray_frontend_cpu_seconds_total"}
    assert {k: middle[k] for k in middle if "cpu" not in k} == {k: after[k] for k in after if "cpu" not in k}

