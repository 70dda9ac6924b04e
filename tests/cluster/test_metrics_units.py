"""Units of /metrics (deploy/metrics.py): the Prometheus text format (one HELP/TYPE per family,
escaped labels, a replica label on every sample, no window reset by a scrape) and the stats cache
(one fetch per interval, shared by concurrent scrapes)."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.stats import EngineActorStats
from cluster.kv_index import KVIndexStats
from cluster.routing import RoutingStats
from cluster.stats import ClusterStats
from deploy.engines import FleetEvents
from deploy.metrics import Page, ServerMetrics, StatsCache, escape_label, format_value
from engine.engine import EngineStats

ODD_REPLICA = 'r"1\\x\nz'  # a quote, a backslash and a newline: each must be escaped


def cluster_stats() -> ClusterStats:
    engines = [EngineActorStats(engine_id=i, healthy=True,
                                engine=EngineStats(prompt_tokens=100 * (i + 1), cached_tokens=40, expert_tokens=[3, i]))
               for i in range(2)]
    index = KVIndexStats(events_applied=[5, 6], resyncs=[1, 1], cached_tokens=[0, 0])
    routing = RoutingStats(policy="kv_events", decisions=[7, 8], reasons={"cache_match": 3}, prefix_hit_rate=0.5,
                           kv_index=index)
    return ClusterStats(engines=engines, routing=routing)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_page_parses_with_one_help_and_type_per_family_and_a_replica_on_every_sample():
    m = ServerMetrics(ODD_REPLICA)
    m.requests["ok"] += 2
    m.ttft.observe(0.2)
    text = m.render(cluster_stats(), FleetEvents(registered=2), refreshes=3)
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(helps) == len(set(helps)) and helps == types
    parsed = list(text_string_to_metric_families(text))  # the reference parser accepts the page
    assert {f.name for f in parsed} >= {"radixray_requests", "radixray_engine_healthy", "radixray_fleet_events"}
    every = [s for f in parsed for s in f.samples]
    assert every and all(s.labels["replica"] == ODD_REPLICA for s in every)
    got = samples(text)
    replica = ("replica", ODD_REPLICA)
    assert got[("radixray_requests_total", (replica, ("status", "ok")))] == 2
    assert got[("radixray_engine_expert_tokens_total", (("engine", "1"), ("expert", "1"), replica))] == 1
    assert got[("radixray_engine_prompt_tokens_total", (("engine", "1"), replica))] == 200
    assert got[("radixray_metrics_refreshes_total", (replica,))] == 3
    assert got[("radixray_time_to_first_token_seconds_bucket", (("le", "0.25"), replica))] == 1
    assert 'replica="r\\"1\\\\x\\nz"' in text and "\nz" not in text


def test_hicache_figures_per_engine_and_tier():
    from engine.hicache.hiradix_cache import HiCacheStats, TierStats

    stats = cluster_stats()
    page = ServerMetrics("r").render(stats)
    assert "radixray_engine_hicache" not in page  # no engine has the hierarchical cache
    tiers = HiCacheStats(device=TierStats(hit_tokens=30, write_bytes=4096),
                         host=TierStats(hit_tokens=8, load_bytes=1024, load_seconds=0.5, loads=2),
                         storage=TierStats(hit_tokens=2), host_used_tokens=40, host_total_tokens=200,
                         storage_pages_written=3, storage_pages_corrupt=1)
    stats.engines[1].engine.hicache = tiers
    got = samples(ServerMetrics("r").render(stats))
    replica = ("replica", "r")
    for tier, n in (("device", 30), ("host", 8), ("storage", 2)):
        assert got[("radixray_engine_hicache_hit_tokens_total", (("engine", "1"), replica, ("tier", tier)))] == n
    assert got[("radixray_engine_hicache_load_bytes_total", (("engine", "1"), replica, ("tier", "host")))] == 1024
    assert got[("radixray_engine_hicache_load_seconds_total", (("engine", "1"), replica, ("tier", "host")))] == 0.5
    assert got[("radixray_engine_hicache_write_bytes_total", (("engine", "1"), replica, ("tier", "device")))] == 4096
    assert got[("radixray_engine_hicache_host_used_tokens", (("engine", "1"), replica))] == 40
    assert got[("radixray_engine_hicache_host_total_tokens", (("engine", "1"), replica))] == 200
    assert got[("radixray_engine_hicache_storage_pages_total", (("engine", "1"), ("op", "corrupt"), replica))] == 1
    assert not any(labels and ("engine", "0") in labels for name, labels in got if "hicache" in name)
    # EngineStats crosses the actor boundary as msgpack: the tiers survive the round trip.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.engines[1].engine), type=EngineStats)
    assert wire.hicache == tiers


def test_a_scrape_resets_nothing():
    """Two scrapes with no traffic between them read the same counters; the per-token gauges
    of a window since the previous scrape are gone (rate() ratios replace them)."""
    m = ServerMetrics("a")
    m.sse_events, m.streamed_tokens = 10, 32
    stats = cluster_stats()
    first, second = samples(m.render(stats)), samples(m.render(stats))
    cpu = ("radixray_frontend_cpu_seconds_total", (("replica", "a"),))
    assert {k: v for k, v in first.items() if k != cpu} == {k: v for k, v in second.items() if k != cpu}
    assert second[cpu] >= first[cpu]
    assert not any(name.endswith("_per_token") or "per_token" in name for name, _ in second)
    m.streamed_tokens += 5
    assert samples(m.render(stats))[("radixray_streamed_tokens_total", (("replica", "a"),))] == 37


def test_text_format_spellings():
    assert format_value(math.nan) == "NaN" and format_value(math.inf) == "+Inf" and format_value(-math.inf) == "-Inf"
    assert format_value(3) == "3" and format_value(True) == "1" and format_value(0.5) == "0.5"
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    page = Page("x")
    page.family("f", "gauge", "a help\nwith a newline")
    assert page.lines[0] == "# HELP f a help\\nwith a newline"
    with pytest.raises(ValueError, match="written twice"):
        page.family("f", "gauge", "again")


def test_stats_cache_fetches_once_per_interval_and_shares_a_fetch_in_flight():
    calls = []

    async def fetch() -> int:
        calls.append(time.monotonic())
        await asyncio.sleep(0.05)
        return len(calls)

    async def run() -> None:
        cache = StatsCache(fetch, refresh_s=3600)
        assert await asyncio.gather(*(cache.get() for _ in range(20))) == [1] * 20  # one fetch in flight, shared
        for _ in range(20):
            assert await cache.get() == 1  # fresh: no fetch
        assert cache.refreshes == len(calls) == 1
        always = StatsCache(fetch, refresh_s=0)
        await always.get()
        await always.get()
        assert always.refreshes == 2  # an interval of 0 fetches on every scrape, still one at a time

    asyncio.run(run())


def test_stats_cache_outlives_a_cancelled_scrape_and_remembers_a_failure():
    outcomes = iter([RuntimeError("engines away"), 7])
    calls = 0

    async def fetch() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def run() -> None:
        cache = StatsCache(fetch, refresh_s=0.3)
        scrape = asyncio.create_task(cache.get())
        await asyncio.sleep(0.01)
        scrape.cancel()  # its client went away: the shared fetch goes on
        waiter = cache.get()
        with pytest.raises(RuntimeError, match="engines away"):
            await waiter
        with pytest.raises(RuntimeError, match="engines away"):  # within the interval: no new fetch
            await cache.get()
        assert calls == 1
        await asyncio.sleep(0.35)
        assert await cache.get() == 7 and calls == 2

    asyncio.run(run())
