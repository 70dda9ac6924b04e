"""`python -m cluster.bench`: the cluster side by side with its baselines, one line per case.

Cases (CPU, 1 torch thread per engine, the engine bench's ~50M random Llama, greedy):
  scale     the engine bench's mixed workload: 2 engines vs 1 engine (output tokens/s).
  routing   multi-tenant shared prefixes (8 x 512-token prefixes, 64 requests), engines whose KV
            holds about half of the prefixes: cache_aware vs round_robin (total tokens/s, hit rates).
  churn     routing under KV churn: 24 tenants' 768-token documents (Zipf popularity), each request
            one of them + a 32-token question, 16 output tokens (prefill-heavy, as RAG and long
            system prompts are); 192 requests, 16 in flight, 2 engines deployed as Serve replicas
            whose KV holds 6 documents each, so they keep evicting; the requests are dealt to M
            front ends (`--frontends`, default 2,8: Clusters following the fleet, as the HTTP
            app's replicas do): kv_events (exact, from the engines' KV events) vs cache_aware
            (each front end's approximate tree) vs round_robin, and Ray Serve's
            PrefixCacheAffinityRouter over the same engines (EngineServer's per-request handle
            path; it matches prefixes on a text with one character per token): the engines'
            actual hit rate, throughput, TTFT p50/p90; and the hit rate no router can pass on
            this request order with the engines' combined KV (Belady's optimal eviction over
            whole documents), and that of one LRU cache of that size. `--hicache-ratio R` gives
            every engine a host tier of R x its pool and adds Serve's router and cache_aware over
            engines without it (routing alone, the issue's baselines) and a TTFT CDF plot.
  churn_low routing at low concurrency: 8 tenants' 400-token prefixes (a 16-token template head
            they share + 384 of their own), each request one of them + a 32-token question, 16
            output tokens; 48 requests (6 per tenant, shuffled) sent one at a time, 2 engines as
            Serve replicas whose KV holds 2,200 tokens each (about four tenants: together, all
            eight), through 1 and 2 front ends (`--frontends` does not apply): every policy's
            actual hit rate, against the ceiling (every tenant's first request misses). No load
            tells the engines apart: a policy that gives ties to the first engine evicts tenants
            there in turn while the other engine holds nothing. Floor: 70% with two front ends.
  http      the same requests streamed through Ray Serve's HTTP app vs the Cluster in Python:
            throughput and time to first visible text (median, p99).
  frontend  stories260K (or the bench model without ../shared), one engine, 32 streams x 256 tokens,
            completions then chat, for each ingress mode (`--ingress`: Serve's proxy, direct
            ingress, HAProxy; deploy/ingress.py), each in a Ray of its own: CPU per streamed token
            of the proxy (or HAProxy), the front end and the engine (read from /proc), SSE events
            per token, tok/s, TTFT and ITL p50/p99 (between events that carry tokens), the same
            streams through the Cluster in Python (HTTP / direct), and the front end's own
            /metrics figures; floors: proxy + front end <= 100 us/token, HTTP >= 0.9x direct.
            `--stream-interval-s` overrides ClusterConfig.stream_interval_s.
  autoscale an engine fleet autoscaled between 1 and 2 engines: idle -> burst -> idle, with a light
            steady stream throughout: time to scale up, time to scale down (with a drain), failures.
  dp        attention-DP: step time of a 2-engine lock-step group vs one engine at the same
            per-engine batch (16), time in collectives, IDLE batches with one-sided load.
  moe       an MoE model (~75M random Qwen3-MoE: 8 experts, top-2, 2/3 of the weights in experts):
            one engine holding every expert vs an attention-DP group of 2 with expert parallelism
            (tokens moved by gather + all-reduce, or by all-to-all; and the intermediate split) vs
            two independent engines; the same 32 requests: output tokens/s, weight bytes per
            engine, time in collectives and bytes each member sent per group step, rows (tokens)
            per group step.
  pd        prefill/decode disaggregation (cluster/bench_pd.py): 8 streaming decodes (600 tokens each)
            while sixteen 1,024-token prompts (a shared 256-token system prompt + 768 of their own)
            arrive 1.5 s apart, on 1 prefill + 1 decode engine vs 2
            unified engines (chunked prefill 256 on all): decode ITL p50/p99, TTFT p50/p99, output
            tokens/s, KV transfer ms and bytes per 1,000 prompt tokens; floors: ITL p99 <= 0.5x
            unified, throughput >= 0.8x. `--plot` writes the ITL and TTFT distributions as a PNG.
  batch     the offline batch job on a 2,000-row multi-tenant shared-prefix JSONL (16 tenants' 256-byte
            prefixes, 32 output tokens), 2 engines: the Ray Data job vs the driver-loop job it replaced
            (`cluster.bench_driver_loop.run_driver_loop`) vs `Cluster.generate` on the same prompts: rows/s,
            output tokens/s, prefix hit rate; each wall time includes starting the engines.
  lora      16 LoRA adapters over 2 engines (cluster/bench_lora.py), 256 requests naming one at random:
            adapter affinity (kv_events) vs round robin: output tokens/s, adapters read again after
            an eviction, copies into device slots.
`--quick` shrinks the workloads (a smoke run, not a measurement to quote)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import ray

from cluster import Cluster, ClusterConfig
from cluster.bench_lora import case_lora
from cluster.bench_pd import case_pd, percentile
from cluster.stats import ClusterStats
from engine import SamplingParams
from engine.bench import BENCH_ARCH, bench_model_path, bench_moe_model_path
from engine.bench_common import random_prompts


def mixed_workload(scale: float) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    n = max(4, int(64 * scale))
    prompts = random_prompts(n, 16, 256, BENCH_ARCH["vocab_size"], rng)
    return prompts, [rng.randint(32, max(33, int(512 * scale))) for _ in range(n)]


def tenant_workload(scale: float) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    tenants, plen, n = 8, max(64, int(512 * scale)), max(16, int(64 * scale))
    prefixes = random_prompts(tenants, plen, plen, BENCH_ARCH["vocab_size"], rng)
    # Tenants arrive in random order (a fixed order could line up with round robin by chance).
    order = [i % tenants for i in range(n)]
    rng.shuffle(order)
    prompts = [prefixes[t] + random_prompts(1, 16, 16, BENCH_ARCH["vocab_size"], rng)[0] for t in order]
    return prompts, [16] * n


CHURN_DOCUMENTS_PER_ENGINE = 6  # each engine's KV, in tenant documents (+ a question each)
CHURN_QUESTION_TOKENS = 32


def churn_workload(scale: float, requests: int | None = None) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts, output lengths, and each prompt's tenant. requests: how many (default 192 x
    scale); a longer trace has the same tenants' documents, and its first requests go to the
    tenants of the default trace's, in its order."""
    rng = random.Random(5)
    tenants, plen = 24, max(64, int(768 * scale))
    n = requests or max(24, int(192 * scale))
    prefixes = random_prompts(tenants, plen, plen, BENCH_ARCH["vocab_size"], rng)
    order = rng.choices(range(tenants), weights=[1 / (k + 1) for k in range(tenants)], k=n)
    q = CHURN_QUESTION_TOKENS
    prompts = [prefixes[t] + random_prompts(1, q, q, BENCH_ARCH["vocab_size"], rng)[0] for t in order]
    return prompts, [16] * n, order


LOW_TENANTS, LOW_PREFIX, LOW_HEAD, LOW_POOL = 8, 400, 16, 2200


def churn_low_workload(scale: float) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts, output lengths, and each prompt's tenant (the churn_low case)."""
    rng = random.Random(9)
    vocab = BENCH_ARCH["vocab_size"]
    head = random_prompts(1, LOW_HEAD, LOW_HEAD, vocab, rng)[0]
    own = LOW_PREFIX - LOW_HEAD
    prefixes = [head + p for p in random_prompts(LOW_TENANTS, own, own, vocab, rng)]
    order = [t % LOW_TENANTS for t in range(max(LOW_TENANTS, int(48 * scale)))]
    rng.shuffle(order)
    q = CHURN_QUESTION_TOKENS
    prompts = [prefixes[t] + random_prompts(1, q, q, vocab, rng)[0] for t in order]
    return prompts, [16] * len(prompts), order


def hit_rate_ceilings(order: list[int], prefix_len: int, prompt_tokens: int, slots: int) -> tuple[float, float]:
    """Prompt-token hit rates of one cache holding `slots` whole tenant prefixes, fed the
    requests in order: with Belady's optimal eviction (an upper bound for any routing over
    engines whose combined KV holds at most `slots` prefixes) and with LRU (what engines
    evicting LRU approach when no prefix is held twice and nothing else takes KV)."""
    following = [len(order)] * len(order)  # the next request of the same tenant
    seen: dict[int, int] = {}
    for i in range(len(order) - 1, -1, -1):
        following[i], seen[order[i]] = seen.get(order[i], len(order)), i

    def hits(evict_optimal: bool) -> int:
        cache: dict[int, int] = {}  # tenant -> its latest request so far
        count = 0
        for i, t in enumerate(order):
            if t in cache:
                count += 1
            elif len(cache) >= slots:  # optimal: the prefix needed again last; LRU: used least recently
                victim = max(cache, key=lambda u: following[cache[u]]) if evict_optimal else min(cache, key=cache.get)
                del cache[victim]
            cache[t] = i
        return count

    return hits(True) * prefix_len / prompt_tokens, hits(False) * prefix_len / prompt_tokens


def run_cluster(cfg: ClusterConfig, prompts: list[list[int]], outs: list[int]) -> tuple[float, ClusterStats]:
    with Cluster(cfg) as cl:
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
        t0 = time.perf_counter()
        results = cl.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        assert [len(r.token_ids) for r in results] == outs, "cluster skipped work"
        stats = cl.stats()
        cl.check_memory()
    return dt, stats


def engine_cfg(path: str, n: int, routing: str, **engine) -> ClusterConfig:
    return ClusterConfig(model_path=path, num_engines=n, routing=routing, device="cpu", cpus_per_engine=1,
                         torch_threads_per_engine=1, engine=engine)


def case_scale(path: str, scale: float) -> None:
    prompts, outs = mixed_workload(scale)
    rates = {}
    for n in (2, 1):
        dt, _ = run_cluster(engine_cfg(path, n, "least_load", max_total_tokens=65536), prompts, outs)
        rates[n] = sum(outs) / dt
    print(f"scale      2_engines={rates[2]:,.1f} out tok/s  1_engine={rates[1]:,.1f} out tok/s  "
          f"ratio={rates[2] / rates[1]:.2f}x (floor 1.7x)", flush=True)


def case_routing(path: str, scale: float) -> None:
    prompts, outs = tenant_workload(scale)
    total = sum(len(p) for p in prompts) + sum(outs)
    pool = int(len(prompts[0]) * 4.5)  # about half of the 8 prefixes per engine
    rates, hits = {}, {}
    for policy in ("cache_aware", "round_robin"):
        dt, stats = run_cluster(engine_cfg(path, 2, policy, max_total_tokens=pool), prompts, outs)
        rates[policy] = total / dt
        e = [x.engine for x in stats.engines]
        hits[policy] = sum(x.cached_tokens for x in e) / max(sum(x.prompt_tokens for x in e), 1)
    print(f"routing    cache_aware={rates['cache_aware']:,.1f} tok/s  round_robin={rates['round_robin']:,.1f} tok/s  "
          f"ratio={rates['cache_aware'] / rates['round_robin']:.2f}x  hit_rate cache_aware={hits['cache_aware']:.0%} "
          f"round_robin={hits['round_robin']:.0%} (floor 1.5x)", flush=True)


def case_churn(path: str, scale: float, frontends: tuple[int, ...] = (2, 8), rate: float | None = None,
               hicache_ratio: float | None = None, plot_path: str | None = None, repeat: int = 1,
               requests: int | None = None) -> None:
    """hicache_ratio: every engine with a host KV tier of that many times its pool (every policy
    on the same engines), the hit rates counting what the host tier gave back; the same run also
    routes with Serve's router and cache_aware over engines without the tier (the issue's
    baselines: routing alone), and prints the ceiling of each (Belady over the KV of both tiers).
    repeat: the whole comparison that many times, each run's lines printed; with more than one,
    the lines again over every run pooled (TTFTs of all runs, mean hit rate, tok/s over the
    summed wall time): one run's p90 moves a lot between runs. requests: the trace's length
    (churn_workload). Closed loop, the first requests in flight together are the first wave,
    every prefix cold under every router: the p90 after it is reported too."""
    prompts, outs, order = churn_workload(scale, requests)
    tiers = {} if hicache_ratio is None else {"enable_hierarchical_cache": True, "hicache_ratio": hicache_ratio}
    arrivals = poisson_arrivals(rate, len(prompts)) if rate else None
    pacing = f"open loop, {rate:g} req/s" if rate else "16 in flight"
    pool = len(prompts[0]) * CHURN_DOCUMENTS_PER_ENGINE
    total = sum(len(p) for p in prompts) + sum(outs)
    prefix_len = len(prompts[0]) - CHURN_QUESTION_TOKENS

    def ceilings(held: float) -> tuple[float, float]:
        slots = -(-int(2 * pool * held) // prefix_len)  # a part of a prefix counts whole: still a bound
        return hit_rate_ceilings(order, prefix_len, sum(len(p) for p in prompts), slots)

    optimal, lru = ceilings(1.0 + (hicache_ratio or 0.0))
    in_flight = 16
    # Imported from where it lives: its public alias, ray.serve.llm, needs vLLM or SGLang installed.
    router = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"

    Run = dict[tuple[str, int, bool], tuple[float, list[float], float, list[float]]]

    def run_once() -> Run:
        """(policy, front ends (0: Serve's one handle), with the tier) -> (wall s, TTFTs, hit rate,
        each request's cached share of its prompt)."""
        raw = {("serve_prefix_affinity", 0, bool(tiers)):
               _serve_router_run(path, pool, prompts, outs, in_flight, router, arrivals, tiers)}
        if tiers:  # routing alone, the baselines the floors compare against
            raw["serve_prefix_affinity", 0, False] = _serve_router_run(path, pool, prompts, outs, in_flight, router,
                                                                       arrivals)
        for m in frontends:
            for policy in ("kv_events", "cache_aware", "round_robin"):
                raw[policy, m, bool(tiers)] = _fleet_run(path, pool, prompts, outs, in_flight, policy, m, arrivals,
                                                         tiers)
            if tiers:
                raw["cache_aware", m, False] = _fleet_run(path, pool, prompts, outs, in_flight, "cache_aware", m,
                                                          arrivals)
        return raw

    def first_wave(m: int) -> int:
        """The requests of the first wave with m front ends (0: Serve's one handle): every front
        end's first window, closed loop; none in an open loop."""
        return 0 if arrivals else in_flight if m == 0 else max(1, in_flight // m) * m

    def report(raw: dict[tuple[str, int, bool], tuple[float, list[float], float, list[float], list[float]]],
               runs: int, note: str) -> None:
        """raw: as run_once's, each value with a fifth item: the TTFTs after the first wave."""
        def summary(key: tuple[str, int, bool]) -> tuple[float, float, float, float]:
            dt, ttfts, hit, _, _ = raw[key]
            return runs * total / dt, hit, statistics.median(ttfts), percentile(ttfts, 0.9)

        def after_wave(label: str, key: tuple[str, int, bool]) -> str:
            return f"{label} {1e3 * percentile(raw[key][4], 0.9):.0f} ms"

        def by_hit(label: str, key: tuple[str, int, bool]) -> str:
            """The requests that missed (under half the prompt cached: the prefix recomputed) and
            their TTFTs beside the others': where the run's p90 falls."""
            _, ttfts, _, cached, _ = raw[key]
            missed = [t for t, c in zip(ttfts, cached) if c < 0.5]
            hits = [t for t, c in zip(ttfts, cached) if c >= 0.5]
            return (f"{label}: {len(missed) / len(ttfts):.0%} missed, TTFT p50 {1e3 * statistics.median(missed or [0]):.0f} "
                    f"ms / p90 {1e3 * percentile(missed, 0.9):.0f} ms; hits p50 {1e3 * statistics.median(hits or [0]):.0f}"
                    f" ms / p90 {1e3 * percentile(hits, 0.9):.0f} ms")

        def line(results: dict[str, tuple[float, float, float, float]]) -> str:
            return "  ".join(f"{p}: {r[0]:,.0f} tok/s hit={r[1]:.0%} ttft_p50={1e3 * r[2]:.0f} ms "
                             f"p90={1e3 * r[3]:.0f} ms" for p, r in results.items())

        tier_note = f", host tier {hicache_ratio:g}x" if tiers else ""
        for m in frontends:
            results = {p: summary((p, m, bool(tiers))) for p in ("kv_events", "cache_aware", "round_robin")}
            results["serve_prefix_affinity"] = summary(("serve_prefix_affinity", 0, bool(tiers)))
            exact = results["kv_events"]
            print(f"churn      {m} front ends, {pacing}{tier_note}{note}: {line(results)}  |  "
                  f"{_churn_floors(exact, results)}  |  any router's hit rate <= {optimal:.0%} (optimal eviction), "
                  f"one LRU cache: {lru:.0%}", flush=True)
            rows = [(f"kv_events{tier_note}", ("kv_events", m, bool(tiers)))]
            if tiers:
                rows += [("serve_prefix_affinity, no tier", ("serve_prefix_affinity", 0, False)),
                         ("cache_aware, no tier", ("cache_aware", m, False))]
            print(f"churn      {m} front ends, {pacing}{note}, requests by hit: "
                  + "  ".join(by_hit(label, key) for label, key in rows), flush=True)
            if not arrivals:
                rows += [(f"cache_aware{tier_note}", ("cache_aware", m, bool(tiers))),
                         (f"serve_prefix_affinity{tier_note}", ("serve_prefix_affinity", 0, bool(tiers)))]
                print(f"churn      {m} front ends, {pacing}{note}, TTFT p90 after the first wave (the first "
                      f"{first_wave(m)} requests of a run, {first_wave(0)} through Serve's handle): "
                      + "  ".join(after_wave(label, key) for label, key in rows), flush=True)
            if tiers:
                pool_only = {"serve_prefix_affinity": summary(("serve_prefix_affinity", 0, False)),
                             "cache_aware": summary(("cache_aware", m, False))}
                pool_optimal, pool_lru = ceilings(1.0)
                print(f"churn      {m} front ends, {pacing}{note}, kv_events with the host tier {hicache_ratio:g}x vs "
                      f"routing alone (no tier): {line(pool_only)}  |  {_churn_floors(exact, pool_only)}  |  "
                      f"without the tier any router's hit rate <= {pool_optimal:.0%}, one LRU cache: {pool_lru:.0%}",
                      flush=True)

    runs = []
    for r in range(repeat):
        runs.append({key: (*v, v[1][first_wave(key[1]):]) for key, v in run_once().items()})
        report(runs[-1], 1, f", run {r + 1} of {repeat}" if repeat > 1 else "")
    pooled = {key: (sum(run[key][0] for run in runs), [t for run in runs for t in run[key][1]],
                    statistics.fmean(run[key][2] for run in runs), [c for run in runs for c in run[key][3]],
                    [t for run in runs for t in run[key][4]])
              for key in runs[0]}
    if repeat > 1:
        report(pooled, repeat, f", {repeat} runs pooled")
    if tiers and plot_path:
        m = frontends[0]
        dists = {f"{policy}, host tier": pooled[policy, m, True][1]
                 for policy in ("kv_events", "cache_aware", "round_robin")}
        dists["serve_prefix_affinity, host tier"] = pooled["serve_prefix_affinity", 0, True][1]
        dists["serve_prefix_affinity, no tier"] = pooled["serve_prefix_affinity", 0, False][1]
        dists["cache_aware, no tier"] = pooled["cache_aware", m, False][1]
        runs_note = f", {repeat} runs pooled" if repeat > 1 else ""
        plot_ttft_cdfs(dists, plot_path, f"churn, {m} front ends, {pacing}, host tier {hicache_ratio:g}x "
                       f"(or none){runs_note}")
        print(f"churn      plot: {plot_path}", flush=True)


def plot_ttft_cdfs(dists: dict[str, list[float]], path: str, title: str) -> None:
    """Each run's TTFT distribution as a CDF, in one PNG (matplotlib: the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ttfts in dists.items():
        xs = sorted(1e3 * t for t in ttfts)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label,
                linestyle="-" if "host tier" in label else "--")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _churn_floors(exact: tuple, others: dict[str, tuple]) -> str:
    """The issue's floors for exact routing's (tok/s, hit, ttft p50, ttft p90) against the
    approximate tree's and Serve's router's."""
    best = min((others["cache_aware"], others["serve_prefix_affinity"]), key=lambda r: r[3])
    return (f"hit kv_events - cache_aware = {100 * (exact[1] - others['cache_aware'][1]):+.0f} points, "
            f"- serve_prefix_affinity = {100 * (exact[1] - others['serve_prefix_affinity'][1]):+.0f} points "
            f"(floor +10)  ttft_p90 kv_events / best other = {exact[3] / best[3]:.2f}x (ceiling 0.8x)")


def case_churn_low(path: str, scale: float) -> None:
    prompts, outs, order = churn_low_workload(scale)
    prompt_tokens = sum(len(p) for p in prompts)
    slots = 2 * LOW_POOL // LOW_PREFIX  # a part of a prefix counts whole: still a bound
    optimal, _ = hit_rate_ceilings(order, LOW_PREFIX, prompt_tokens, slots)
    optimal += len(set(order)) * LOW_HEAD / prompt_tokens  # a tenant's first request may hit the shared head
    for m in (1, 2):
        hits = {}
        for policy in ("kv_events", "cache_aware", "least_load", "round_robin"):
            _, _, hits[policy], _ = _fleet_run(path, LOW_POOL, prompts, outs, 1, policy, m)
        best = max(hits, key=hits.get)
        print(f"churn_low  {m} front end{'s' if m > 1 else ''}, one request at a time: "
              + "  ".join(f"{p} hit={h:.0%}" for p, h in hits.items())
              + f"  |  best {best}{' (floor 70%)' if m == 2 else ''}, any router's hit rate <= {optimal:.0%}", flush=True)


def _deploy_engines(path: str, pool: int, app: str, router_class: str | None = None,
                    engine: dict | None = None) -> tuple[Any, list]:
    """Two EngineServer replicas (engines as in engine_cfg) and their Fleet, as Serve deploys
    them for the HTTP app: the Fleet handle and the engine actors."""
    from ray import serve

    from deploy.engines import Fleet, engine_deployment
    from deploy.options import FleetOptions

    _serve_base()
    args = {"model_path": path, "num_engines": 1, "device": "cpu", "cpus_per_engine": 1,
            "torch_threads_per_engine": 1, "engine": {"max_total_tokens": pool, **(engine or {})}}
    dep = engine_deployment(engine_cfg(path, 2, "round_robin", max_total_tokens=pool, **(engine or {})), FleetOptions())
    if router_class is not None:
        dep = dep.options(request_router_config={"request_router_class": router_class})
    serve.run(dep.bind(args, Fleet.bind()), name=app, route_prefix=None)
    fleet = serve.get_deployment_handle("Fleet", app)
    version, members = None, []
    while len(members) < 2:
        version, members = fleet.watch.remote(version).result()
    return fleet, [m[2] for m in members]


def _engine_hit_rate(engines: list) -> float:
    """The engines' actual prefix hit rate (their caches' own counts); checks their memory too."""
    stats = [s.engine for s in ray.get([e.stats.remote() for e in engines])]
    ray.get([e.check_memory.remote() for e in engines])
    return sum(e.cached_tokens for e in stats) / max(sum(e.prompt_tokens for e in stats), 1)


def _fleet_run(path: str, pool: int, prompts: list[list[int]], outs: list[int], in_flight: int, policy: str,
               frontends: int, arrivals: list[float] | None = None,
               engine: dict | None = None) -> tuple[float, list[float], float, list[float]]:
    """The workload through `frontends` front ends (Clusters following one engine fleet, as the
    HTTP app's replicas do), requests dealt to them in turn: wall time, TTFTs, the engines'
    actual hit rate, and each request's share of prompt tokens served from cache (aligned with
    the TTFTs). Closed loop (in_flight at once; 1: one request at a time over all the front
    ends, in order), or open loop: request i sent at arrivals[i] seconds, its TTFT counted from
    then. engine: EngineConfig fields beyond the pool size."""
    from ray import serve

    fleet, engines = _deploy_engines(path, pool, "bench-fleet", engine=engine)
    cfg = ClusterConfig(model_path=path, routing=policy, stream_interval_s=0.0)
    fronts = [Cluster(cfg, fleet=fleet) for _ in range(frontends)]
    try:
        for cl in fronts:
            while len(cl.healthy()) < 2:
                time.sleep(0.1)

        async def part(cl: Cluster, share: list[tuple[list[int], int, float]], start: float) -> list[tuple[float, float]]:
            gate = _Gate(max(1, in_flight // frontends), start, arrivals is not None)

            async def one(ids: list[int], n: int, at: float) -> tuple[float, float]:
                async with gate.slot(at) as t0:
                    first, got, cached = None, 0, 0
                    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                    async for d in cl.stream_ids(ids, params):
                        got += len(d.token_ids)
                        cached = max(cached, d.cached_tokens)
                        if first is None and d.token_ids:
                            first = time.perf_counter() - t0
                    assert got == n, "a request skipped work"
                    return first, cached / len(ids)

            return list(await asyncio.gather(*(one(*w) for w in share)))

        work = list(zip(prompts, outs, arrivals or [0.0] * len(prompts)))
        t0 = time.perf_counter()
        if in_flight == 1 and arrivals is None:  # each request after the previous one ended
            timings = [t for k, w in enumerate(work) for t in asyncio.run_coroutine_threadsafe(
                part(fronts[k % frontends], [w], t0), fronts[k % frontends]._loop).result()]
        else:
            futures = [asyncio.run_coroutine_threadsafe(part(cl, work[i::frontends], t0), cl._loop)
                       for i, cl in enumerate(fronts)]
            timings = [None] * len(work)  # in request order
            for i, f in enumerate(futures):
                timings[i::frontends] = f.result()
        dt = time.perf_counter() - t0
        hit = _engine_hit_rate(engines)
    finally:
        for cl in fronts:
            cl.shutdown()
        serve.delete("bench-fleet")
    return dt, [t for t, _ in timings], hit, [c for _, c in timings]


@functools.cache
def _serve_base() -> str:
    """Serve's HTTP proxy, started once per bench process (its port cannot change later)."""
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


class _Gate:
    """A bench client's pacing: closed loop (at most `width` requests at once) or open loop
    (each request at its arrival time, `start` + at). `slot(at)` yields when the request's
    clock starts, read from `clock` (the event loop's own clock in the tests, whose sleeps it
    times)."""

    def __init__(self, width: int, start: float, open_loop: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.semaphore, self.start, self.open_loop, self.clock = asyncio.Semaphore(width), start, open_loop, clock

    @contextlib.asynccontextmanager
    async def slot(self, at: float) -> AsyncIterator[float]:
        if self.open_loop:
            await asyncio.sleep(max(0.0, self.start + at - self.clock()))
            yield self.start + at
            return
        async with self.semaphore:
            yield self.clock()


def poisson_arrivals(rate: float, n: int, seed: int = 7) -> list[float]:
    """Arrival times (s) of n requests at `rate` per second, exponential gaps."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _serve_router_run(path: str, pool: int, prompts: list[list[int]], outs: list[int], in_flight: int,
                      router_class: str, arrivals: list[float] | None = None,
                      engine: dict | None = None) -> tuple[float, list[float], float, list[float]]:
    """The churn workload through Serve's handle path with one of Serve's request routers: two
    EngineServer replicas (engines as in engine_cfg), one stream per request; paced, and
    returned, as in _fleet_run."""
    from ray import serve

    from actors.protocol import decode_delta
    from deploy.engines import GenerateCall

    _, engines = _deploy_engines(path, pool, "bench-router", router_class, engine)
    handle = serve.get_deployment_handle("EngineServer", "bench-router")

    async def run() -> tuple[float, list[tuple[float, float]]]:
        gate = _Gate(in_flight, time.perf_counter(), arrivals is not None)

        async def one(ids: list[int], n: int, at: float) -> tuple[float, float]:
            async with gate.slot(at) as t0:
                call = GenerateCall(rid=os.urandom(8).hex(), input_ids=ids, prompt="".join(chr(0x100 + t) for t in ids),
                                    sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                first, got, cached = None, 0, 0
                async for item in handle.options(stream=True).generate.remote(call):
                    d = decode_delta(item)
                    got += len(d.token_ids)
                    cached = max(cached, d.cached_tokens)
                    if first is None and d.token_ids:
                        first = time.perf_counter() - t0
                assert got == n, "a request skipped work"
                return first, cached / len(ids)

        timings = await asyncio.gather(*(one(*w) for w in zip(prompts, outs, arrivals or [0.0] * len(prompts))))
        return time.perf_counter() - gate.start, list(timings)

    dt, timings = asyncio.run(run())
    hit = _engine_hit_rate(engines)
    serve.delete("bench-router")
    return dt, [t for t, _ in timings], hit, [c for _, c in timings]


def case_http(path: str, scale: float) -> None:
    from ray import serve

    from deploy.app import build_app

    prompts, outs = mixed_workload(scale * 0.5)
    cfg = engine_cfg(path, 2, "least_load", max_total_tokens=65536)

    async def direct(cl: Cluster) -> tuple[float, list[float]]:
        async def one(ids, n):
            t0 = time.perf_counter()
            first = None
            async for d in cl.stream_ids(ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)):
                if first is None and d.text:  # first visible text: what an HTTP client sees first
                    first = time.perf_counter() - t0
            return first if first is not None else time.perf_counter() - t0

        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs)))
        return time.perf_counter() - t0, list(ttfts)

    with Cluster(cfg) as cl:
        dt_direct, ttft_direct = cl.run(direct(cl))

    base = _serve_base()
    serve.run(build_app({"model_path": path, "num_engines": 2, "routing": "least_load", "device": "cpu",
                         "torch_threads_per_engine": 1, "engine": {"max_total_tokens": 65536}}),
              name="bench", route_prefix="/")
    url = f"{base}/v1/completions"
    dt_http, ttft_http = asyncio.run(_http_load(url, prompts, outs))
    serve.delete("bench")
    tok = sum(outs)
    print(f"http       http={tok / dt_http:,.1f} out tok/s  direct={tok / dt_direct:,.1f} out tok/s  "
          f"ratio={dt_direct / dt_http:.2f}x (floor 0.85x)  ttft_median http={1e3 * statistics.median(ttft_http):.0f} ms "
          f"direct={1e3 * statistics.median(ttft_direct):.0f} ms  ttft_p99 http={1e3 * percentile(ttft_http, 0.99):.0f} ms "
          f"direct={1e3 * percentile(ttft_direct, 0.99):.0f} ms", flush=True)


async def _http_load(url: str, prompts: list[list[int]], outs: list[int]) -> tuple[float, list[float]]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(ids, n):
            body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
            t0, first, got = time.perf_counter(), None, 0
            async with session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {") and first is None:
                        if json.loads(line[6:])["choices"][0]["text"]:
                            first = time.perf_counter() - t0
                    got += line.startswith("data: ")
            return first if first is not None else time.perf_counter() - t0

        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs)))
        return time.perf_counter() - t0, list(ttfts)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_dp(path: str, scale: float) -> None:
    """Attention-DP: per-step cost of the lock-step group vs a lone engine at the same
    per-engine batch, time in collectives, and IDLE batches when one member gets all requests."""
    rng = random.Random(3)
    per_engine, out = 16, max(16, int(64 * scale))
    prompts = random_prompts(2 * per_engine, 32, 32, BENCH_ARCH["vocab_size"], rng)
    params = SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)

    def timed(cl: Cluster, ids: list[list[int]]) -> float:
        t0 = time.perf_counter()
        cl.generate(input_ids=ids, sampling_params=params)
        return time.perf_counter() - t0

    base = dict(model_path=path, routing="round_robin", device="cpu", cpus_per_engine=1, torch_threads_per_engine=1,
                engine={"max_total_tokens": 16384})
    with Cluster(ClusterConfig(num_engines=1, **base)) as cl:
        dt = timed(cl, prompts[:per_engine])
        single_step = dt / sum(cl.stats().engines[0].engine.batches_by_mode.values())
    with Cluster(ClusterConfig(num_engines=2, enable_dp_attention=True, **base)) as cl:
        dt = timed(cl, prompts)
        dp = [e.dp for e in cl.stats().engines]
        group_step = dt / dp[0].steps
        coll = sum(d.collective_seconds for d in dp) / len(dp) / dp[0].steps
    with Cluster(ClusterConfig(num_engines=2, enable_dp_attention=True, **{**base, "routing": "least_load"})) as cl:
        for ids in prompts[:8]:  # one at a time: least_load always picks member 0
            cl.generate(input_ids=ids, sampling_params=params)
        # Only the modes that ran: the stats list every mode.
        modes = [{m: n for m, n in e.engine.batches_by_mode.items() if n} for e in cl.stats().engines]
    print(f"dp         group_step={1e3 * group_step:.1f} ms  single_step={1e3 * single_step:.1f} ms  "
          f"ratio={group_step / single_step:.2f}x  collectives={1e3 * coll:.1f} ms/step  "
          f"one-sided: member0={modes[0]} member1={modes[1]}", flush=True)


def case_moe(path: str, scale: float) -> None:
    """MoE: one engine with every expert vs an attention-DP group of 2 with expert parallelism
    (gather + all-reduce, all-to-all) and with the intermediate split vs two independent engines,
    on the same requests. same_tokens: greedy outputs equal to the lone engine's."""
    moe_path = bench_moe_model_path()
    rng = random.Random(6)
    n, out = max(8, int(32 * scale)), max(16, int(128 * scale))
    prompts = random_prompts(n, 32, 64, BENCH_ARCH["vocab_size"], rng)
    params = SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)
    base = dict(model_path=moe_path, routing="round_robin", device="cpu", cpus_per_engine=1,
                torch_threads_per_engine=1, engine={"max_total_tokens": 16384})
    dp = dict(num_engines=2, enable_dp_attention=True)
    setups = {"one_engine": dict(num_engines=1), "ep_group": dp,
              "ep_all_to_all": dict(dp, engine={**base["engine"], "moe_dispatch": "all_to_all"}),
              "intermediate_group": dict(dp, moe_split="intermediate"), "two_engines": dict(num_engines=2)}
    parts, tokens = [], None
    for name, setup in setups.items():
        with Cluster(ClusterConfig(**{**base, **setup})) as cl:
            t0 = time.perf_counter()
            results = cl.generate(input_ids=prompts, sampling_params=params)
            dt = time.perf_counter() - t0
            assert all(len(r.token_ids) == out for r in results), "cluster skipped work"
            got = [r.token_ids for r in results]
            tokens = tokens or got
            stats = cl.stats().engines
            weights = max(i.weight_bytes for i in cl.infos)
            cl.check_memory()
        line = (f"{name}: {n * out / dt:,.0f} out tok/s weights={weights / 2**20:.0f} MiB/engine "
                f"same_tokens={sum(a == b for a, b in zip(got, tokens))}/{n}")
        if setup.get("enable_dp_attention"):
            steps = stats[0].dp.steps
            coll = sum(e.dp.collective_seconds for e in stats) / len(stats) / steps
            sent = sum(e.dp.collective_bytes for e in stats) / len(stats) / steps
            rows = sum(e.engine.prompt_tokens - e.engine.cached_tokens + e.engine.generated_tokens
                       - e.engine.num_received for e in stats) / steps
            line += (f" step={1e3 * dt / steps:.1f} ms collectives={1e3 * coll:.1f} ms/step "
                     f"sent={sent / 2**10:.0f} KiB/step/member rows={rows:.0f}/step")
        parts.append(line)
    print("moe        " + "  |  ".join(parts), flush=True)


def batch_workload(scale: float) -> list[dict]:
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz "
    tenants, n = 16, max(64, int(2000 * scale))
    prefixes = ["".join(rng.choices(letters, k=256)) for _ in range(tenants)]
    return [{"id": f"r{i}", "prompt": prefixes[rng.randrange(tenants)] + "".join(rng.choices(letters, k=16)),
             "max_tokens": 32, "temperature": 0, "ignore_eos": True} for i in range(n)]


def case_batch(path: str, scale: float) -> None:
    """The Ray Data batch job vs the driver-loop job vs Cluster.generate, on the same rows."""
    import tempfile

    from cluster.batch import BatchOptions, run
    from cluster.bench_driver_loop import run_driver_loop

    rows = batch_workload(scale)
    cfg = engine_cfg(path, 2, "cache_aware", max_total_tokens=65536)
    results = {}
    with tempfile.TemporaryDirectory(prefix="radixray-bench-batch-") as tmp:
        inp = os.path.join(tmp, "prompts.jsonl")
        with open(inp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for name in ("ray_data", "driver_loop"):
            if name == "ray_data":
                s = run(BatchOptions(input=inp, output=os.path.join(tmp, name), progress=False), cfg)
            else:
                s = run_driver_loop(cfg, inp, os.path.join(tmp, name + ".jsonl"))
            assert (s.rows, s.errors, s.completion_tokens) == (len(rows), 0, 32 * len(rows)), f"{name} skipped work"
            results[name] = (s.rows / s.wall_s, s.completion_tokens / s.wall_s, s.prefix_hit_rate)
    t0 = time.perf_counter()
    with Cluster(cfg) as cl:
        outs = cl.generate(prompt=[r["prompt"] for r in rows],
                           sampling_params=SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
        engines = [e.engine for e in cl.stats().engines]
    dt = time.perf_counter() - t0
    hit = sum(e.cached_tokens for e in engines) / max(sum(e.prompt_tokens for e in engines), 1)
    results["generate"] = (len(rows) / dt, sum(len(o.token_ids) for o in outs) / dt, hit)
    line = "  ".join(f"{k}: {r[0]:,.1f} rows/s {r[1]:,.0f} tok/s hit={r[2]:.1%}" for k, r in results.items())
    ratio = results["ray_data"][0] / results["driver_loop"][0]
    gap = 100 * (results["ray_data"][2] - results["generate"][2])
    print(f"batch      {len(rows)} rows  {line}  |  ray_data / driver_loop = {ratio:.2f}x (floor 1.0x)  "
          f"hit ray_data - generate = {gap:+.1f} points (floor -5)", flush=True)


FRONTEND_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "stories260K")
FRONTEND_RESULT = "FRONTEND_RESULT "  # the line a frontend child prints its figures on
FRONTEND_STREAMS = 32


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_cores() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat (every process,
    ours or not: how loaded the machine was during a run)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), sum(fields) / os.sysconf("SC_CLK_TCK")


def _pids(*titles: str) -> list[int]:
    """Processes whose command line (Ray sets "ray::<actor>") contains one of `titles`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if any(t.encode() in cmd for t in titles):
                out.append(int(entry))
    return out


def _latency_summary(ttfts: list[float], itls: list[float]) -> dict:
    return {"ttft_p50": statistics.median(ttfts), "ttft_p99": percentile(ttfts, 0.99),
            "itl_p50": statistics.median(itls) if itls else 0.0, "itl_p99": percentile(itls, 0.99) if itls else 0.0}


class _SSEUsage(msgspec.Struct):
    completion_tokens: int = 0


class _SSEChunk(msgspec.Struct):
    """What the load generator reads of an event (the rest is skipped by the decoder)."""

    choices: list = []
    usage: _SSEUsage | None = None


async def _sse_load(url: str, bodies: list[dict]) -> dict:
    """Stream every body at once: tokens (from the chunks' running usage), SSE events that carry
    tokens, TTFT and ITL (between such events), wall time. The client shares the machine's cores
    with the server, so it decodes only what it counts."""
    import aiohttp

    decode = msgspec.json.Decoder(_SSEChunk).decode

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(body: dict) -> tuple[float, list[float], int, int]:
            t0 = time.perf_counter()
            last, first, gaps, events, tokens = None, None, [], 0, 0
            async with session.post(url, json={**body, "stream": True, "stream_options": {
                    "include_usage": True, "continuous_usage_stats": True}}) as r:
                assert r.status == 200, await r.text()
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = decode(line[6:])
                    if not chunk.choices or chunk.usage is None:
                        continue
                    now = time.perf_counter()
                    got = chunk.usage.completion_tokens - tokens
                    if got <= 0:
                        continue
                    tokens += got
                    events += 1
                    if first is None:
                        first = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
            return first, gaps, events, tokens

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(r[3] for r in results), "events": sum(r[2] for r in results),
            **_latency_summary([r[0] for r in results], [g for r in results for g in r[1]])}


def _metric_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Samples of a Prometheus text page by family name (labels dropped: one front end, one
    sample per family; several would add up)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(value)
    return out


FRONTEND_METRICS = ("radixray_sse_events_total", "radixray_streamed_tokens_total", "radixray_frontend_cpu_seconds_total")


def frontend_child(mode: str, model: str, scale: float, interval_s: float | None) -> dict:
    """One ingress mode in the Ray this process started (the mode is in its environment):
    direct Cluster streams, then the same streams over HTTP, completions and chat."""
    import httpx
    from ray import serve

    from deploy.app import build_app
    from deploy.ingress import direct_urls

    streams, tokens = FRONTEND_STREAMS, max(32, int(256 * scale))
    prompts = [f"Story {i}: Once upon a time" for i in range(streams)]
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    extra = {} if interval_s is None else {"stream_interval_s": interval_s}
    result: dict = {"mode": mode, "tokens": streams * tokens}

    cfg = ClusterConfig(model_path=model, num_engines=1, device="cpu", cpus_per_engine=1, torch_threads_per_engine=1,
                        **extra)
    result["stream_interval_s"] = cfg.stream_interval_s
    with Cluster(cfg) as cl:
        async def direct() -> dict:
            async def one(p: str) -> tuple[float, list[float], int]:
                t0, first, last, gaps, got = time.perf_counter(), None, 0.0, [], 0
                async for d in cl.stream(p, params):
                    if d.token_ids:
                        now = time.perf_counter()
                        if first is None:
                            first = now - t0
                        else:
                            gaps.append(now - last)
                        last, got = now, got + len(d.token_ids)
                return first, gaps, got

            t0 = time.perf_counter()
            runs = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - t0
            assert sum(r[2] for r in runs) == streams * tokens, "direct calls skipped work"
            return {"wall": wall, **_latency_summary([r[0] for r in runs], [g for r in runs for g in r[1]])}

        cl.run(direct())  # warm-up
        engine_pids = _pids("ray::EngineActor")
        cpu0, busy0 = sum(_proc_cpu_s(p) for p in engine_pids), _busy_cores()
        result["direct"] = cl.run(direct())
        busy1 = _busy_cores()
        result["direct"]["engine_cpu"] = sum(_proc_cpu_s(p) for p in engine_pids) - cpu0
        result["direct"]["busy"] = (busy1[0] - busy0[0]) / result["direct"]["wall"]

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model_path": model, "num_engines": 1, "device": "cpu", "torch_threads_per_engine": 1,
                         **extra}), name="bench-frontend", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    if mode == "direct":
        deadline = time.monotonic() + 60
        while not (urls := direct_urls("bench-frontend", "127.0.0.1")) and time.monotonic() < deadline:
            time.sleep(0.5)
        base = urls[0]
    if mode == "haproxy":  # HAProxy learns the replicas' ports a moment after the app is ready
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
    result["url"] = base
    procs = {"proxy": _pids("ray::ProxyActor", "ray::HAProxyManager", "/haproxy"),
             "front end": _pids("ServeReplica:bench-frontend:OpenAIServer"), "engine": _pids("ray::EngineActor")}
    for endpoint, make in (("completions", lambda p: {"prompt": p}),
                           ("chat", lambda p: {"messages": [{"role": "user", "content": p}]})):
        url = f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        bodies = [{**make(p), "max_tokens": tokens, "temperature": 0, "ignore_eos": True} for p in prompts]
        asyncio.run(_sse_load(url, bodies[:4]))  # warm-up
        metrics_before = _metric_values(httpx.get(f"{base}/metrics", timeout=30).text, FRONTEND_METRICS)
        before, busy0 = {k: sum(_proc_cpu_s(p) for p in pids) for k, pids in procs.items()}, _busy_cores()
        r = asyncio.run(_sse_load(url, bodies))
        cpu = {k: sum(_proc_cpu_s(p) for p in pids) - before[k] for k, pids in procs.items()}
        r["busy"] = (_busy_cores()[0] - busy0[0]) / r["wall"]
        metrics_after = _metric_values(httpx.get(f"{base}/metrics", timeout=30).text, FRONTEND_METRICS)
        assert r["tokens"] == streams * tokens, "the HTTP run skipped work"
        r["cpu"] = cpu
        r["metrics"] = {k: metrics_after.get(k, 0.0) - metrics_before.get(k, 0.0) for k in FRONTEND_METRICS}
        result[endpoint] = r
    serve.delete("bench-frontend")
    serve.shutdown()
    return result


def _frontend_line(r: dict, endpoint: str) -> str:
    e, d, n = r[endpoint], r["direct"], r["tokens"]
    us = {k: 1e6 * v / n for k, v in e["cpu"].items()}
    front = us["proxy"] + us["front end"]
    m = e["metrics"]
    own = (f"  /metrics: events/token={m['radixray_sse_events_total'] / max(m['radixray_streamed_tokens_total'], 1):.2f} "
           f"front end CPU={1e6 * m['radixray_frontend_cpu_seconds_total'] / max(m['radixray_streamed_tokens_total'], 1):,.0f} "
           "us/tok") if m.get("radixray_streamed_tokens_total") else ""
    ratio = d["wall"] / e["wall"]
    verdict = (f"  floors: proxy+front end<=100 {'met' if front <= 100 else 'MISSED'}, "
               f"http/direct>=0.9x {'met' if ratio >= 0.9 else 'MISSED'}")
    return (f"frontend   {r['mode']:<7} {endpoint:<11} {n / e['wall']:,.0f} tok/s (direct {n / d['wall']:,.0f}, "
            f"http/direct={ratio:.2f}x, floor 0.9x)  CPU proxy={us['proxy']:,.0f} "
            f"front end={us['front end']:,.0f} engine={us['engine']:,.0f} us/tok  proxy+front end={front:,.0f} us/tok "
            f"(ceiling 100)  events/token={e['events'] / n:.2f}  ttft p50={1e3 * e['ttft_p50']:.0f} ms "
            f"p99={1e3 * e['ttft_p99']:.0f} ms (direct {1e3 * d['ttft_p50']:.0f}/{1e3 * d['ttft_p99']:.0f})  "
            f"itl p50={1e3 * e['itl_p50']:.1f} ms p99={1e3 * e['itl_p99']:.1f} ms "
            f"(direct {1e3 * d['itl_p50']:.1f}/{1e3 * d['itl_p99']:.1f}){own}  machine busy={e['busy']:.1f} "
            f"cores (direct {d['busy']:.1f}, engine {1e6 * d['engine_cpu'] / n:,.0f} us/tok){verdict}")


def case_frontend(path: str, scale: float, ingress: tuple[str, ...] = ("proxy", "direct", "haproxy"),
                  interval_s: float | None = None, model: str | None = None) -> None:
    """Each ingress mode in a Ray of its own (Serve reads the mode when its processes start),
    one after the other, each in a child process: stories260K (or `model`), one engine, 32 streams."""
    import subprocess
    import sys

    from deploy.ingress import environment

    model = model or (os.path.realpath(FRONTEND_MODEL) if os.path.isdir(FRONTEND_MODEL) else path)
    for mode in ingress:
        argv = [sys.executable, "-m", "cluster.bench", "--frontend-child", mode, "--model", model,
                "--scale", str(scale)] + ([] if interval_s is None else ["--stream-interval-s", str(interval_s)])
        proc = subprocess.run(argv, env={**os.environ, **environment(mode)}, capture_output=True, text=True,
                              timeout=3600)
        lines = [x for x in proc.stdout.splitlines() if x.startswith(FRONTEND_RESULT)]
        if proc.returncode or not lines:
            print(f"frontend   {mode}: failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}",
                  flush=True)
            continue
        r = json.loads(lines[-1][len(FRONTEND_RESULT):])
        print(f"# frontend {mode}: {r['url']}, stream_interval_s={r['stream_interval_s']}", flush=True)
        for endpoint in ("completions", "chat"):
            print(_frontend_line(r, endpoint), flush=True)


def case_autoscale(path: str, scale: float) -> None:
    import threading

    import httpx
    from ray import serve

    from deploy.app import build_app

    model = os.path.realpath(FRONTEND_MODEL) if os.path.isdir(FRONTEND_MODEL) else path
    base = _serve_base()
    serve.run(build_app({"model_path": model, "min_engines": 1, "max_engines": 2, "device": "cpu",
                         "torch_threads_per_engine": 1, "target_waiting_per_engine": 1, "upscale_delay_s": 1,
                         "downscale_delay_s": 10, "drain_reroute_after_s": 5, "engine": {"max_running_requests": 4}}),
              name="bench-autoscale", route_prefix="/")

    def engines() -> int:
        return len(httpx.get(f"{base}/health", timeout=30).json()["engines"])

    failures, done = [], 0
    lock = threading.Lock()

    def client(stop: threading.Event, max_tokens: int) -> None:
        nonlocal done
        while not stop.is_set():
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            with lock:
                done += 1
                if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] != "length":
                    failures.append(r.text[:200])

    def wait_for(n: int, timeout_s: float = 300) -> float:
        t0 = time.perf_counter()
        while engines() != n:
            assert time.perf_counter() - t0 < timeout_s, f"the fleet never reached {n} engines"
            time.sleep(0.25)
        return time.perf_counter() - t0

    stop_steady, stop_burst = threading.Event(), threading.Event()
    steady = threading.Thread(target=client, args=(stop_steady, 32))
    steady.start()
    time.sleep(5)  # idle (one light stream)
    burst = [threading.Thread(target=client, args=(stop_burst, 256)) for _ in range(16)]
    for t in burst:
        t.start()
    up = wait_for(2)
    time.sleep(10 * scale)
    stop_burst.set()
    for t in burst:
        t.join()
    down = wait_for(1)
    stop_steady.set()
    steady.join()
    serve.delete("bench-autoscale")
    print(f"autoscale  1 -> 2 engines {up:.1f} s after the burst began; 2 -> 1 engines {down:.1f} s after it ended "
          f"(downscale delay 10 s, drain included)  requests={done} failed={len(failures)} (must be 0)"
          + (f"  first failure: {failures[0]}" if failures else ""), flush=True)


CASES = {"scale": case_scale, "routing": case_routing, "churn": case_churn, "churn_low": case_churn_low,
         "http": case_http, "dp": case_dp, "moe": case_moe, "batch": case_batch, "frontend": case_frontend,
         "autoscale": case_autoscale, "pd": case_pd, "lora": case_lora}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="scale,routing,churn,churn_low,http,dp,moe,batch",
                    help=f"comma list of {list(CASES)}")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--frontends", default="2,8", help="churn: comma list of front-end counts to run the policies with")
    ap.add_argument("--rate", type=float, default=None,
                    help="churn: open loop, requests arriving at this rate (Poisson, per second); default: closed loop")
    ap.add_argument("--hicache-ratio", type=float, default=None,
                    help="churn: give every engine a host KV tier of this many times its pool (e.g. 4); default: none")
    ap.add_argument("--repeat", type=int, default=1,
                    help="churn: run the whole comparison this many times, then report every run pooled")
    ap.add_argument("--churn-requests", type=int, default=0,
                    help="churn: the trace's length in requests (the same tenants; its first requests go to the "
                    "default trace's tenants, in its order); default: 192 (24 with --quick)")
    ap.add_argument("--churn-plot", default="",
                    help="churn with --hicache-ratio: where to write the TTFT distributions' PNG (matplotlib; "
                    "docs/images/churn_tiers_ttft.png is the one docs/BENCHMARKS.md shows); default: none")
    ap.add_argument("--ingress", default="proxy,direct,haproxy",
                    help="frontend: the ingress modes to compare, in this order (deploy/ingress.py)")
    ap.add_argument("--stream-interval-s", type=float, default=None,
                    help="frontend: ClusterConfig.stream_interval_s (default: its default)")
    ap.add_argument("--frontend-model", default=None,
                    help="frontend: the model to serve (default: stories260K beside the checkout, else the bench model)")
    ap.add_argument("--frontend-child", help=argparse.SUPPRESS)  # one ingress mode, in its own Ray
    ap.add_argument("--plot", default="docs/images/pd_latency.png",
                    help="pd: where to write the latency distributions' PNG (needs matplotlib: pip install -e .[bench]); '' for none")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.churn_requests and args.churn_requests < 16:
        ap.error("--churn-requests must be at least 16 (the requests a closed loop keeps in flight)")
    if args.frontend_child:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        result = frontend_child(args.frontend_child, args.model, args.scale, args.stream_interval_s)
        print(FRONTEND_RESULT + json.dumps(result), flush=True)
        ray.shutdown()
        return
    path = bench_model_path()
    scale = 0.125 if args.quick else 1.0
    print(f"# cluster bench: {len(os.sched_getaffinity(0))} CPUs, model {path}", flush=True)
    for name in args.cases.split(","):
        if name == "frontend":  # its children start a Ray each: none of ours may run meanwhile
            if ray.is_initialized():
                ray.shutdown()
            case_frontend(path, scale, ingress=tuple(args.ingress.split(",")), interval_s=args.stream_interval_s,
                          model=args.frontend_model)
            continue
        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        if name == "pd":
            case_pd(path, scale, plot_path=args.plot or None)
            continue
        if name == "churn":
            case_churn(path, scale, frontends=tuple(int(m) for m in args.frontends.split(",")), rate=args.rate,
                       hicache_ratio=args.hicache_ratio, plot_path=args.churn_plot or None, repeat=args.repeat,
                       requests=args.churn_requests or None)
            continue
        CASES[name](path, scale)
    if ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    main()
