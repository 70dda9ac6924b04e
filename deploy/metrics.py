"""Prometheus text exposition, written by hand (no global registry: several apps per process).

Every sample carries the front-end replica that wrote it (`replica`): behind the proxy or HAProxy
successive scrapes reach different replicas, and only per replica do counters never go back.
Nothing on the page depends on when it was last read; ratios are PromQL's (`rate(a) / rate(b)`).
The engines' figures come from a StatsCache, so the scrape rate does not set the engines' load."""

from __future__ import annotations

import asyncio
import bisect
import math
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec

if TYPE_CHECKING:
    from cluster.stats import ClusterStats
    from deploy.engines import FleetEvents

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
T = TypeVar("T")


def escape_label(value: str) -> str:
    """A label value as the text format writes it (backslash, double quote, newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value in the text format's spelling (NaN, +Inf, -Inf; integers without a point)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Page:
    """One exposition page: each family's HELP and TYPE lines once, then its samples, every one
    labelled with the replica that wrote the page (after the family's own labels)."""

    def __init__(self, replica: str) -> None:
        self.lines: list[str] = []
        self.families: set[str] = set()
        self.replica = f'replica="{escape_label(replica)}"'

    def family(self, name: str, kind: str, help_text: str) -> None:
        if name in self.families:
            raise ValueError(f"metric family {name} is written twice")
        self.families.add(name)
        help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, labels: dict[str, object] | None = None) -> None:
        pairs = [f'{k}="{escape_label(str(v))}"' for k, v in (labels or {}).items()]
        self.lines.append(f"{name}{{{','.join([*pairs, self.replica])}}} {format_value(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, page: Page, name: str, help_text: str) -> None:
        page.family(name, "histogram", help_text)
        acc = 0
        for bound, count in zip(self.buckets, self.counts):
            acc += count
            page.sample(f"{name}_bucket", acc, {"le": format_value(bound)})
        acc += self.counts[-1]
        page.sample(f"{name}_bucket", acc, {"le": "+Inf"})
        page.sample(f"{name}_sum", self.sum)
        page.sample(f"{name}_count", acc)


def process_cpu_s() -> float:
    """User + system CPU seconds of this whole process (every thread) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StatsCache(Generic[T]):
    """What an expensive fetch (every engine's stats) last returned, refreshed at most once per
    `refresh_s` whatever the scrape rate: scrapes that arrive while a refresh runs wait for that
    one, and a scrape whose client goes away does not cancel it. A failed fetch is remembered
    like a value (raised to the scrapes of its interval), so failures do not refresh faster."""

    def __init__(self, fetch: Callable[[], Awaitable[T]], refresh_s: float) -> None:
        self.fetch, self.refresh_s = fetch, refresh_s
        self.refreshes = 0  # fetches started: what the engines were asked, whatever the scrapes
        self._outcome: tuple[T | None, Exception | None] | None = None  # (value, error) of the last fetch
        self._at = -math.inf  # when it ended (time.monotonic)
        self._inflight: asyncio.Future[T] | None = None

    async def get(self) -> T:
        if self._outcome is not None and time.monotonic() - self._at < self.refresh_s:
            value, error = self._outcome
            if error is not None:
                raise error
            return value  # type: ignore[return-value]
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._refresh())
            # Read its outcome even when every scrape waiting for it was cancelled.
            self._inflight.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._inflight)

    async def _refresh(self) -> T:
        self.refreshes += 1
        try:
            value = await self.fetch()
        except Exception as e:
            self._outcome, self._at = (None, e), time.monotonic()
            raise
        finally:
            self._inflight = None
        self._outcome, self._at = (value, None), time.monotonic()
        return value


class ServerMetrics:
    """One front-end replica's own counters (monotonic for its lifetime) and its page."""

    def __init__(self, replica: str = "local") -> None:
        self.replica = replica  # the Serve replica id; "local" outside Serve
        self.requests: Counter[str] = Counter()  # by final status: ok, error, aborted, invalid
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.sse_events = 0  # written on streams: data events and keep-alive comments
        self.streamed_tokens = 0  # tokens those events carried
        self.cpu_start = process_cpu_s()

    def _own(self, page: Page) -> None:
        page.family("radixray_requests_total", "counter", "Requests by final status.")
        for status in ("ok", "error", "aborted", "invalid"):
            page.sample("radixray_requests_total", self.requests[status], {"status": status})
        page.family("radixray_prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
        page.sample("radixray_prompt_tokens_total", self.prompt_tokens)
        page.family("radixray_generation_tokens_total", "counter", "Generated tokens.")
        page.sample("radixray_generation_tokens_total", self.generation_tokens)
        self.ttft.render(page, "radixray_time_to_first_token_seconds", "Time to first token.")
        self.itl.render(page, "radixray_inter_token_latency_seconds",
                        "Time between a stream's deltas (coalesced tokens arrive together).")
        # Streaming cost; per token: rate(radixray_sse_events_total[5m]) / rate(radixray_streamed_tokens_total[5m])
        # and rate(radixray_frontend_cpu_seconds_total[5m]) / rate(radixray_streamed_tokens_total[5m]).
        page.family("radixray_sse_events_total", "counter",
                    "SSE events written on streams (data events and keep-alive comments).")
        page.sample("radixray_sse_events_total", self.sse_events)
        page.family("radixray_streamed_tokens_total", "counter", "Generated tokens sent on streams.")
        page.sample("radixray_streamed_tokens_total", self.streamed_tokens)
        page.family("radixray_frontend_cpu_seconds_total", "counter",
                    "CPU time (user + system, every thread) of this front-end process since it started serving.")
        page.sample("radixray_frontend_cpu_seconds_total", process_cpu_s() - self.cpu_start)

    @staticmethod
    def _hicache(page: Page, engines: list) -> None:
        """The hierarchical cache's figures, per engine and tier (written when an engine has one)."""
        tiered = [e for e in engines if e.engine.hicache is not None]
        if not tiered:
            return
        per_tier = {
            "radixray_engine_hicache_hit_tokens_total": ("Prompt tokens admitted from the tier (device: the KV pool, "
                                                         "host, storage); they add up to cached_tokens.", "hit_tokens"),
            "radixray_engine_hicache_load_bytes_total": ("Bytes of KV loaded from the tier into the one above it.",
                                                         "load_bytes"),
            "radixray_engine_hicache_write_bytes_total": ("Bytes of KV written from the tier into the one below it.",
                                                          "write_bytes"),
            "radixray_engine_hicache_load_seconds_total": ("Seconds spent loading KV from the tier.", "load_seconds"),
            "radixray_engine_hicache_loads_total": ("Loads from the tier (each one batched copy).", "loads"),
        }
        for name, (help_text, field) in per_tier.items():
            page.family(name, "counter", help_text)
            for eng in tiered:
                h = eng.engine.hicache
                for tier in ("device", "host", "storage"):
                    page.sample(name, getattr(getattr(h, tier), field), {"engine": eng.engine_id, "tier": tier})
        gauges = {
            "radixray_engine_hicache_host_used_tokens": ("Tokens of KV the host tier holds.", "host_used_tokens"),
            "radixray_engine_hicache_host_total_tokens": ("The host tier's capacity in tokens.", "host_total_tokens"),
        }
        for name, (help_text, field) in gauges.items():
            page.family(name, "gauge", help_text)
            for eng in tiered:
                page.sample(name, getattr(eng.engine.hicache, field), {"engine": eng.engine_id})
        name = "radixray_engine_hicache_storage_pages_total"
        page.family(name, "counter", "Storage tier pages this engine wrote, read, found corrupt (a miss) or failed "
                    "to write.")
        for eng in tiered:
            h = eng.engine.hicache
            for op, n in (("written", h.storage_pages_written), ("read", h.storage_pages_read),
                          ("corrupt", h.storage_pages_corrupt), ("write_error", h.storage_write_errors)):
                page.sample(name, n, {"engine": eng.engine_id, "op": op})

    def render(self, cluster_stats: ClusterStats, fleet: FleetEvents | None = None, refreshes: int = 0) -> str:
        """The page: this replica's counters, then the engines' and the fleet's figures as this
        replica last fetched them (`refreshes`: how many fetches it has made)."""
        page = Page(self.replica)
        self._own(page)
        page.family("radixray_metrics_refreshes_total", "counter",
                    "Times this front end fetched the engines' stats for this page (at most one per metrics_refresh_s).")
        page.sample("radixray_metrics_refreshes_total", refreshes)
        engines = cluster_stats.engines
        gauges = {
            "radixray_engine_waiting_requests": ("Requests queued in the engine.", lambda e: e.engine.waiting),
            "radixray_engine_running_requests": ("Requests decoding in the engine.", lambda e: e.engine.running),
            "radixray_engine_kv_usage_ratio": ("KV slots held by requests / total.",
                                               lambda e: e.engine.kv_used / max(e.engine.kv_total, 1)),
            "radixray_engine_cache_hit_rate": ("Prompt tokens served from the radix cache / prompt tokens, since "
                                               "the engine started.",
                                               lambda e: e.engine.cached_tokens / max(e.engine.prompt_tokens, 1)),
            "radixray_engine_healthy": ("1 when the engine answers health checks.", lambda e: int(e.healthy)),
        }
        for name, (help_text, get) in gauges.items():
            page.family(name, "gauge", help_text)
            for eng in engines:
                page.sample(name, get(eng), {"engine": eng.engine_id})
        routing, index = cluster_stats.routing, cluster_stats.routing.kv_index
        per_engine = {
            "radixray_engine_prompt_tokens_total": ("Prompt tokens the engine received.",
                                                    [e.engine.prompt_tokens for e in engines]),
            "radixray_engine_cached_tokens_total": ("Prompt tokens the engine served from its radix cache.",
                                                    [e.engine.cached_tokens for e in engines]),
            "radixray_routing_decisions_total": ("Requests this front end routed to the engine.", routing.decisions),
            "radixray_kv_events_applied_total": ("The engine's KV events applied to this front end's routing index.",
                                                 index.events_applied),
            "radixray_kv_index_resyncs_total": ("Snapshots that resynced the routing index (gaps, restarts).",
                                                index.resyncs),
            "radixray_spec_draft_tokens_total": ("Speculative draft tokens verified.",
                                                 [e.engine.spec_draft_tokens for e in engines]),
            "radixray_spec_accepted_tokens_total": ("Speculative draft tokens accepted.",
                                                    [e.engine.spec_accepted_tokens for e in engines]),
            "radixray_spec_verify_requests_total": ("Requests in verify steps (each emits accepted + 1 tokens).",
                                                    [e.engine.spec_verify_requests for e in engines]),
        }
        for name, (help_text, values) in per_engine.items():
            page.family(name, "counter", help_text)
            for eng, value in zip(engines, values):
                page.sample(name, value, {"engine": eng.engine_id})
        # Prefill/decode disaggregation, labelled with the engine's pool (role): sum by role for per-pool figures.
        page.family("radixray_engine_role", "gauge", "1 for the engine's disaggregation role: prefill, decode, "
                    "or null (both).")
        for eng in engines:
            page.sample("radixray_engine_role", 1, {"engine": eng.engine_id, "role": eng.role})
        page.family("radixray_kv_prealloc_queue", "gauge", "Decode engine: requests waiting for KV memory or "
                    "for their KV to arrive.")
        for eng in engines:
            page.sample("radixray_kv_prealloc_queue", eng.engine.prealloc_queue, {"engine": eng.engine_id,
                                                                                  "role": eng.role})
        transfers = {
            "radixray_kv_transfers_total": ("KV transfers completed (sent by a prefill engine, received by a decode "
                                            "engine).", lambda e: e.engine.kv_transfers),
            "radixray_kv_transfer_bytes_total": ("Bytes of KV those transfers carried.",
                                                 lambda e: e.engine.kv_transfer_bytes),
            "radixray_kv_transfer_seconds_total": ("Decode engine: seconds from asking for a request's KV to its "
                                                   "arrival, the prefill included.",
                                                   lambda e: e.engine.kv_transfer_seconds),
            "radixray_kv_wire_seconds_total": ("Decode engine: seconds from the prefill engine handing the KV over "
                                               "to its arrival (the transfer alone).", lambda e: e.engine.kv_wire_seconds),
            "radixray_kv_skipped_tokens_total": ("Decode engine: prompt tokens its own cache held, not transferred.",
                                                 lambda e: e.engine.kv_skipped_tokens),
        }
        for name, (help_text, get) in transfers.items():
            page.family(name, "counter", help_text)
            for eng in engines:
                page.sample(name, get(eng), {"engine": eng.engine_id, "role": eng.role})
        name = "radixray_engine_expert_tokens_total"
        page.family(name, "counter", "MoE: (token, expert) pairs the engine's experts computed (an attention-DP "
                    "member with expert parallelism counts its own experts only).")
        for eng in engines:
            for expert, n in enumerate(eng.engine.expert_tokens):
                page.sample(name, n, {"engine": eng.engine_id, "expert": expert})
        self._hicache(page, engines)
        actual = sum(e.engine.cached_tokens for e in engines) / max(sum(e.engine.prompt_tokens for e in engines), 1)
        page.family("radixray_prefix_hit_rate", "gauge",
                    "Prompt tokens the engines served from their caches / prompt tokens, since they started.")
        page.sample("radixray_prefix_hit_rate", actual)
        page.family("radixray_router_prefix_hit_rate", "gauge", "This front end's router's estimate of the same.")
        page.sample("radixray_router_prefix_hit_rate", routing.prefix_hit_rate)
        page.family("radixray_routing_reasons_total", "counter", "Routing decisions by reason (this front end).")
        for reason in ("cache_match", "load", "fallback"):
            page.sample("radixray_routing_reasons_total", routing.reasons.get(reason, 0), {"reason": reason})
        page.family("radixray_fleet_engines", "gauge", "Engines this front end routes to.")
        page.sample("radixray_fleet_engines", len(engines))
        if fleet is not None:
            page.family("radixray_fleet_events_total", "counter",
                        "Engines registered, drained, left cleanly, or lost (lease expired).")
            for event, n in msgspec.structs.asdict(fleet).items():
                page.sample("radixray_fleet_events_total", n, {"event": event})
        return page.text()
