"""Prometheus text exposition, written by hand (no global registry: several apps per process)."""

from __future__ import annotations

import bisect
import math
import resource
from collections import Counter
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from cluster.stats import ClusterStats
    from deploy.engines import FleetEvents

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for bound, count in zip(self.buckets, self.counts):
            acc += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {acc}')
        acc += self.counts[-1]
        lines += [f'{name}_bucket{{le="+Inf"}} {acc}', f"{name}_sum {self.sum}", f"{name}_count {acc}"]
        return lines


def process_cpu_s() -> float:
    """User + system CPU seconds of this whole process (every thread) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ServerMetrics:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()  # by final status: ok, error, aborted, invalid
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.sse_events = 0  # written on streams: data events and keep-alive comments
        self.streamed_tokens = 0  # tokens those events carried
        self.cpu_start = process_cpu_s()
        self._last_scrape = (self.cpu_start, 0, 0)  # (CPU seconds, tokens, events) at the previous render

    def streaming_lines(self) -> list[str]:
        """Streaming cost: events and tokens streamed, the process's CPU time, and, since the
        previous scrape of this page, events per token and CPU seconds per streamed token (NaN
        when no token was streamed meanwhile)."""
        cpu, tokens, events = process_cpu_s(), self.streamed_tokens, self.sse_events
        last_cpu, last_tokens, last_events = self._last_scrape
        self._last_scrape = (cpu, tokens, events)
        window = tokens - last_tokens
        return [
            "# HELP radixray_sse_events_total SSE events written on streams (data events and keep-alive comments).",
            "# TYPE radixray_sse_events_total counter", f"radixray_sse_events_total {events}",
            "# HELP radixray_streamed_tokens_total Generated tokens sent on streams.",
            "# TYPE radixray_streamed_tokens_total counter", f"radixray_streamed_tokens_total {tokens}",
            "# HELP radixray_frontend_cpu_seconds_total CPU time (user + system, every thread) of this front-end "
            "process since it started serving.",
            "# TYPE radixray_frontend_cpu_seconds_total counter",
            f"radixray_frontend_cpu_seconds_total {cpu - self.cpu_start}",
            "# HELP radixray_sse_events_per_token SSE events per streamed token since the previous scrape.",
            "# TYPE radixray_sse_events_per_token gauge",
            f"radixray_sse_events_per_token {(events - last_events) / window if window else math.nan}",
            "# HELP radixray_frontend_cpu_per_token_seconds This front-end process's CPU time per streamed token "
            "since the previous scrape (all its work, streaming or not).",
            "# TYPE radixray_frontend_cpu_per_token_seconds gauge",
            f"radixray_frontend_cpu_per_token_seconds {(cpu - last_cpu) / window if window else math.nan}"]

    def render(self, cluster_stats: ClusterStats, fleet: FleetEvents | None = None) -> str:
        lines = ["# HELP radixray_requests_total Requests by final status.", "# TYPE radixray_requests_total counter"]
        for status in ("ok", "error", "aborted", "invalid"):
            lines.append(f'radixray_requests_total{{status="{status}"}} {self.requests[status]}')
        lines += ["# HELP radixray_prompt_tokens_total Prompt tokens of finished requests.",
                  "# TYPE radixray_prompt_tokens_total counter", f"radixray_prompt_tokens_total {self.prompt_tokens}",
                  "# HELP radixray_generation_tokens_total Generated tokens.",
                  "# TYPE radixray_generation_tokens_total counter",
                  f"radixray_generation_tokens_total {self.generation_tokens}"]
        lines += self.ttft.render("radixray_time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.render("radixray_inter_token_latency_seconds",
                                 "Time between a stream's deltas (coalesced tokens arrive together).")
        lines += self.streaming_lines()
        gauges = {
            "radixray_engine_waiting_requests": ("Requests queued in the engine.", lambda e: e.engine.waiting),
            "radixray_engine_running_requests": ("Requests decoding in the engine.", lambda e: e.engine.running),
            "radixray_engine_kv_usage_ratio": ("KV slots held by requests / total.",
                                               lambda e: e.engine.kv_used / max(e.engine.kv_total, 1)),
            "radixray_engine_cache_hit_rate": ("Prompt tokens served from the radix cache.",
                                               lambda e: e.engine.cached_tokens / max(e.engine.prompt_tokens, 1)),
            "radixray_engine_healthy": ("1 when the engine answers health checks.", lambda e: int(e.healthy)),
        }
        for name, (help_text, get) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for eng in cluster_stats.engines:
                lines.append(f'{name}{{engine="{eng.engine_id}"}} {get(eng)}')
        routing, index = cluster_stats.routing, cluster_stats.routing.kv_index
        per_engine = {
            "radixray_routing_decisions_total": ("counter", "Requests routed to the engine.", routing.decisions),
            "radixray_kv_events_applied_total": ("counter", "The engine's KV events applied to the routing index.",
                                                 index.events_applied),
            "radixray_kv_index_resyncs_total": ("counter", "Snapshots that resynced the routing index (gaps, restarts).",
                                                index.resyncs),
            "radixray_spec_draft_tokens_total": ("counter", "Speculative draft tokens verified.",
                                                 [e.engine.spec_draft_tokens for e in cluster_stats.engines]),
            "radixray_spec_accepted_tokens_total": ("counter", "Speculative draft tokens accepted.",
                                                    [e.engine.spec_accepted_tokens for e in cluster_stats.engines]),
            "radixray_spec_verify_requests_total": ("counter", "Requests in verify steps (each emits accepted + 1 tokens).",
                                                    [e.engine.spec_verify_requests for e in cluster_stats.engines]),
        }
        for name, (kind, help_text, values) in per_engine.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{engine="{e.engine_id}"}} {v}' for e, v in zip(cluster_stats.engines, values)]
        name = "radixray_engine_expert_tokens_total"
        lines += [f"# HELP {name} MoE: (token, expert) pairs the engine's experts computed (an attention-DP member "
                  "with expert parallelism counts its own experts only).", f"# TYPE {name} counter"]
        for eng in cluster_stats.engines:
            lines += [f'{name}{{engine="{eng.engine_id}",expert="{e}"}} {n}'
                      for e, n in enumerate(eng.engine.expert_tokens)]
        engines = [e.engine for e in cluster_stats.engines]
        actual = sum(e.cached_tokens for e in engines) / max(sum(e.prompt_tokens for e in engines), 1)
        lines += ["# HELP radixray_prefix_hit_rate Prompt tokens the engines served from their caches / prompt tokens.",
                  "# TYPE radixray_prefix_hit_rate gauge", f"radixray_prefix_hit_rate {actual}",
                  "# HELP radixray_router_prefix_hit_rate The router's estimate of the same.",
                  "# TYPE radixray_router_prefix_hit_rate gauge",
                  f"radixray_router_prefix_hit_rate {routing.prefix_hit_rate}"]
        lines += ["# HELP radixray_routing_reasons_total Routing decisions by reason (this front end).",
                  "# TYPE radixray_routing_reasons_total counter"]
        lines += [f'radixray_routing_reasons_total{{reason="{r}"}} {routing.reasons.get(r, 0)}'
                  for r in ("cache_match", "load", "fallback")]
        lines += ["# HELP radixray_fleet_engines Engines this front end routes to.", "# TYPE radixray_fleet_engines gauge",
                  f"radixray_fleet_engines {len(cluster_stats.engines)}"]
        if fleet is not None:
            lines += ["# HELP radixray_fleet_events_total Engines registered, drained, left cleanly, or lost "
                      "(lease expired).", "# TYPE radixray_fleet_events_total counter"]
            lines += [f'radixray_fleet_events_total{{event="{k}"}} {v}'
                      for k, v in msgspec.structs.asdict(fleet).items()]
        return "\n".join(lines) + "\n"
