"""The fleet on real Ray Serve: engines as a deployment (one replica each), front ends that
scale out, routing on the engines' KV events, autoscaling with drain, a killed engine replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import ray

from deploy.app import build_app
from tests.serve.helpers import engines_of, wait_for_engines

PREFIX = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
          "with her friends. One day, she saw a big red ball under a tree and ran to get it. ")


def metric(base: str, line_start: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])


def stream_completion(base: str, body: dict, on_event=None) -> tuple[str, list[dict]]:
    """(finish_reason or "error", events) of one streamed completion."""
    events: list[dict] = []
    with httpx.Client(timeout=180) as c, c.stream("POST", f"{base}/v1/completions",
                                                   json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"http {r.status_code}", events
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if on_event is not None:
                    on_event(events)
    if any("error" in e for e in events):
        return "error", events
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    return (finishes[-1] if finishes else "none"), events


@contextlib.contextmanager
def deployed(serve_base: str, name: str, args: dict, engines: int) -> Iterator[str]:
    """The app `build_app(args)` under /name, once `engines` engines serve it; deleted after,
    without waiting: its replicas stop (each engine drains first) while the next tests run."""
    from ray import serve

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    try:
        base = f"{serve_base}/{name}"
        wait_for_engines(base, engines)
        yield base
    finally:
        serve.delete(name, _blocking=False)


@pytest.fixture(scope="module")
def fleet(serve_base, model_dirs):
    with deployed(serve_base, "fleet", {"model_path": model_dirs["stories"], "num_engines": 2, "frontends": 2,
                                        "routing": "kv_events", "engine": {"max_running_requests": 4}}, 2) as base:
        yield base


def test_shared_prefix_lands_on_one_engine_through_either_front_end(fleet):
    base = fleet
    engines = engines_of(base)
    before = [s.engine.num_received for s in ray.get([e.stats.remote() for e in engines])]
    prefix_len = httpx.post(f"{base}/tokenize", json={"prompt": PREFIX}).json()["count"]
    frontends, cached = set(), []
    for i in range(16):
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"prompt": PREFIX + f"Day {i}:", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        frontends.add(r.headers["x-radixray-frontend"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.2)  # the KV events of the last request reach both front ends
    assert len(frontends) == 2, "the proxy sent every request to one front end"
    # Every request after the first found the prefix cached: all went to the engine holding it.
    assert min(cached[1:]) >= prefix_len - 1, cached
    after = [s.engine.num_received for s in ray.get([e.stats.remote() for e in engines])]
    assert sorted(a - b for a, b in zip(after, before)) == [0, 16]
    assert metric(base, 'radixray_routing_reasons_total{reason="cache_match",') > 0


def scrape(base: str) -> tuple[str, dict[tuple, float], dict[tuple, float]]:
    return metrics_page(httpx.get(f"{base}/metrics", timeout=30))


def metrics_page(r: httpx.Response) -> tuple[str, dict[tuple, float], dict[tuple, float]]:
    """(the front end that answered, its counters' samples, its gauges' samples) of one /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    assert r.status_code == 200, r.text
    replica, counters, gauges = r.headers["x-radixray-frontend"], {}, {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("replica") == replica, (s, replica)  # each sample names its front end
            into = gauges if family.type == "gauge" else counters  # counters and histograms only grow
            into[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return replica, counters, gauges


def refreshes_bound(pages: list[tuple[str, dict, dict]], elapsed_s: float, refresh_s: float) -> None:
    """Each front end fetched the engines' stats at most once per refresh_s over the pages."""
    seen: dict[str, list[float]] = {}
    for replica, counters, _ in pages:
        seen.setdefault(replica, []).append(counters[("radixray_metrics_refreshes_total", (("replica", replica),))])
    bound = int(elapsed_s // refresh_s) + 1
    for replica, values in seen.items():
        assert max(values) - min(values) <= bound, (replica, values, elapsed_s)


def test_metrics_per_front_end_never_go_back_and_scrapes_share_engine_fetches(fleet):
    """Behind the proxy successive scrapes reach either front end: per (series, front end) no
    counter goes back, whatever the other front end counted. Twenty scrapes in a row, or at once,
    make each front end fetch the engines' stats at most once per metrics_refresh_s."""
    base, refresh_s = fleet, 1.0  # HTTPOptions.metrics_refresh_s's default
    pages = []
    for i in range(12):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": f"Day {i}:", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        pages.append(scrape(base))
    assert len({p[0] for p in pages}) == 2, "the proxy sent every scrape to one front end"
    first: dict[tuple[str, tuple], float] = {}
    last: dict[tuple[str, tuple], float] = {}
    for replica, counters, _ in pages:
        for key, value in counters.items():
            assert value >= last.get((replica, key), 0.0), (replica, key, last[(replica, key)], value)
            first.setdefault((replica, key), value)
            last[(replica, key)] = value
    grew = {replica for (replica, (name, labels)), v in last.items()
            if name == "radixray_requests_total" and ("status", "ok") in labels and v > first[(replica, (name, labels))]}
    assert grew, "no front end's request counter moved while the scrapes watched it"

    t0 = time.monotonic()
    in_a_row = [scrape(base) for _ in range(20)]
    refreshes_bound(in_a_row, time.monotonic() - t0, refresh_s)

    async def at_once() -> list:
        async with httpx.AsyncClient(timeout=30) as client:
            return [metrics_page(r) for r in await asyncio.gather(*(client.get(f"{base}/metrics") for _ in range(20)))]

    t0 = time.monotonic()
    together = asyncio.run(at_once())
    refreshes_bound(together, time.monotonic() - t0, refresh_s)


def test_a_killed_engine_replica_is_replaced_and_its_requests_end_cleanly(fleet):
    """Requests without a token yet move to the other engine; streaming ones end with an
    explicit error; Serve replaces the replica, which serves again."""
    base = fleet
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    victim = engines_of(base)[0]
    results: list[str] = []
    started = threading.Barrier(13)

    def one(i: int) -> None:
        started.wait()
        results.append(stream_completion(base, {**body, "prompt": f"{i} " + body["prompt"]})[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(1.0)  # 12 requests on 2 engines of 4 rows each: some decode, some wait
    ray.kill(victim, no_restart=True)
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 12
    assert set(results) <= {"length", "error"}, results
    assert results.count("length") >= 4, results  # at least the other engine's, and the re-routed
    wait_for_engines(base, 2)
    assert victim not in engines_of(base)  # a new replica, with a new engine
    finish, _ = stream_completion(base, {**body, "max_tokens": 8})
    assert finish == "length"
    ray.get([e.check_memory.remote() for e in engines_of(base)], timeout=120)


def test_a_rolling_update_under_load_loses_no_request(fleet, model_dirs):
    """A config change replaces every replica (one engine at a time, each after its drain) while
    clients stream: no request fails, and the fleet ends with new engines that serve."""
    from ray import serve

    base = fleet
    old = {e._actor_id for e in engines_of(base)}
    failures: list[str] = []
    done: list[int] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            finish, events = stream_completion(base, {"prompt": f"{i} Once upon a time", "max_tokens": 32,
                                                      "temperature": 0, "ignore_eos": True})
            done.append(i)
            if finish != "length":
                failures.append(f"{finish}: {[e['error'] for e in events if 'error' in e]}")

    def completed(n: int) -> None:
        """Until n more requests have ended (a condition, not a sleep)."""
        target, deadline = len(done) + n, time.monotonic() + 120
        while len(done) < target:
            assert time.monotonic() < deadline and not stop.is_set(), (len(done), target, failures)
            time.sleep(0.05)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in clients:
        t.start()
    try:
        completed(len(clients))  # every client streams before the update...
        serve.run(build_app({"model_path": model_dirs["stories"], "num_engines": 2, "frontends": 2,
                             "routing": "kv_events", "engine": {"max_running_requests": 3}}),
                  name="fleet", route_prefix="/fleet")
        wait_for_engines(base, 2)
        completed(len(clients))  # ...and after it, on the new engines
    finally:  # the clients stop whatever happened (a failure leaves none running)
        stop.set()
        for t in clients:
            t.join(timeout=300)
    assert not failures, failures
    new = engines_of(base)
    assert not old & {e._actor_id for e in new}, "an engine was not replaced"
    ray.get([e.check_memory.remote() for e in new], timeout=120)


@pytest.fixture(scope="module")
def autoscaled(serve_base, model_dirs):
    from ray import serve

    # The fleet app's tests come first in this module and have all run: its replicas stop while
    # this app starts, instead of idling beside it until the module ends.
    serve.delete("fleet", _blocking=False)
    args = {"model_path": model_dirs["stories"], "min_engines": 1, "max_engines": 2, "target_waiting_per_engine": 1,
            "upscale_delay_s": 0.5, "downscale_delay_s": 2, "drain_reroute_after_s": 2, "drain_timeout_s": 60,
            "engine": {"max_running_requests": 2}}
    with deployed(serve_base, "autoscaled", args, 1) as base:
        yield base


def test_burst_scales_up_and_a_steady_stream_survives_the_drain_back_down(autoscaled):
    base = autoscaled
    failures: list[str] = []

    def client(stop: threading.Event, max_tokens: int) -> None:
        while not stop.is_set():
            body = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True, "max_tokens": max_tokens}
            finish, events = stream_completion(base, body)
            if finish != "length":
                failures.append(f"{finish}: {[e['error'] for e in events if 'error' in e]}")

    stop_burst, stop_steady = threading.Event(), threading.Event()
    burst = [threading.Thread(target=client, args=(stop_burst, 96)) for _ in range(8)]
    steady = threading.Thread(target=client, args=(stop_steady, 24))
    for t in burst:
        t.start()
    try:
        wait_for_engines(base, 2, timeout_s=240)  # the queue behind 2 rows made the fleet grow
        drains = metric(base, 'radixray_fleet_events_total{event="drains",')
        steady.start()
        stop_burst.set()
        for t in burst:
            t.join(timeout=300)
        wait_for_engines(base, 1, timeout_s=240)  # light load: back down, draining one engine
    finally:  # the clients stop whatever happened (a failure leaves none running)
        stop_burst.set()
        stop_steady.set()
        for t in [*burst, steady]:
            if t.is_alive():
                t.join(timeout=300)
    assert metric(base, 'radixray_fleet_events_total{event="drains",') >= drains + 1
    assert not failures, failures
    ray.get([e.check_memory.remote() for e in engines_of(base)], timeout=120)

