"""`python -m engine.bench --cases hicache`: the hierarchical KV cache (engine/hicache) on two traces,
three engines side by side in one run, on the bench model:

- chat: multi-turn sessions (16 at scale 1) (a system prompt of their own, then turns that each add a user message
  and a reply); each round visits every session in a new random order, so a session returns
  after the others have filled the pool. A turn's prompt is its session's whole history.
- churn: the cluster bench's churn trace on one engine: 24 tenants' documents with Zipf
  popularity, each request one of them + a 32-token question.

The pool holds the four requests in flight and little more: a chat session is gone from it when it
returns, and so are all but the last few churn documents. Engines: pool only (the radix cache
alone), host tier (`enable_hierarchical_cache`, a host tier twice the pool, SGLang's default), host + storage (the
same host tier over a file storage tier in a temporary folder, which holds everything). Per engine:
the hit rate (prompt tokens served from any tier / prompt tokens), the prompt tokens computed,
and TTFT p50/p90 (four requests in flight, stepped here). Then the eviction policies (lru, lfu,
slru, cost_aware) replayed on the same traces, and on a churn trace whose popularity reverses
halfway ("shift"), through a capacity-limited cache with no model
(`CacheManager` over a one-float KV pool of the same token capacity), pool only and with the host
tier: the hit rate per policy against lru. TTFT and hit rates go to a PNG."""

from __future__ import annotations

import gc
import os
import random
import tempfile
import time

import torch

from engine.bench_common import line, random_prompts
from engine.cache_manager import CacheManager
from engine.config import ModelConfig
from engine.engine import Engine, StreamDelta
from engine.hicache.config import HiCacheConfig
from engine.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from engine.req import Req
from engine.sampling import SamplingParams

PLOT_PATH = "docs/images/hicache_ttft.png"
POLICIES = ("lru", "lfu", "slru", "cost_aware")
HOST_RATIO = 2.0
IN_FLIGHT = 4
OUTPUT_TOKENS = 8
CPU = torch.device("cpu")


class Trace:
    """A trace's prompts in order and the device pool (tokens) its engines get."""

    def __init__(self, name: str, prompts: list[list[int]], pool: int) -> None:
        self.name, self.prompts, self.pool = name, prompts, pool


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


def chat_trace(scale: float, vocab: int) -> Trace:
    """Sessions of turns; each round visits every session once, in a new order."""
    rng = random.Random(11)
    sessions, turns = max(12, int(16 * scale)), max(3, int(6 * scale))
    system, user, reply = (
        max(32, int(256 * scale)),
        max(16, int(64 * scale)),
        max(16, int(64 * scale)),
    )
    history = [_tokens(rng, system, vocab) for _ in range(sessions)]
    prompts = []
    for _ in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for s in order:
            history[s] = history[s] + _tokens(rng, user, vocab)
            prompts.append(list(history[s]))
            history[s] = history[s] + _tokens(
                rng, reply, vocab
            )  # the assistant's reply, as sent back
    longest = max(len(p) for p in prompts)
    return Trace("chat", prompts, IN_FLIGHT * (longest + OUTPUT_TOKENS) + longest // 2)


def churn_trace(scale: float, vocab: int) -> Trace:
    """The cluster bench's churn workload (24 tenants' documents, Zipf popularity) on one engine."""
    rng = random.Random(5)  # the same draws as cluster/bench.py's churn_workload: the same prompts
    tenants, plen, n = 24, max(64, int(768 * scale)), max(24, int(192 * scale))
    docs = random_prompts(tenants, plen, plen, vocab, rng)
    order = rng.choices(range(tenants), weights=[1 / (k + 1) for k in range(tenants)], k=n)
    prompts = [docs[t] + random_prompts(1, 32, 32, vocab, rng)[0] for t in order]
    return Trace("churn", prompts, 6 * (plen + 32 + OUTPUT_TOKENS))


def shift_trace(scale: float, vocab: int) -> Trace:
    """The churn trace's shape with a popularity shift halfway: the second half draws the tenants
    in the reverse Zipf order (yesterday's rarest documents are today's most asked), where
    counting past hits (lfu) keeps the wrong documents."""
    rng = random.Random(7)
    tenants, plen, n = 24, max(64, int(768 * scale)), max(24, int(192 * scale))
    docs = random_prompts(tenants, plen, plen, vocab, rng)
    weights = [1 / (k + 1) for k in range(tenants)]
    order = rng.choices(range(tenants), weights=weights, k=n // 2)
    order += rng.choices(list(reversed(range(tenants))), weights=weights, k=n - n // 2)
    prompts = [docs[t] + random_prompts(1, 32, 32, vocab, rng)[0] for t in order]
    return Trace("shift", prompts, 6 * (plen + 32 + OUTPUT_TOKENS))


def engine_configs(storage_dir: str) -> dict[str, dict]:
    host = {"enable_hierarchical_cache": True, "hicache_ratio": HOST_RATIO}
    return {
        "pool only": {},
        "host tier": host,
        "host + storage": {
            **host,
            "hicache_storage_backend": "file",
            "hicache_storage_path": storage_dir,
        },
    }


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_trace(eng: Engine, prompts: list[list[int]]) -> list[float]:
    """Every prompt, IN_FLIGHT at a time in trace order (a chat session's next turn is always in a
    later wave: the rounds visit each session once); returns each request's TTFT in seconds."""
    params = SamplingParams(max_new_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    first: dict[str, float] = {}
    done: set[str] = set()

    def sink(delta: StreamDelta) -> None:
        first.setdefault(delta.rid, time.perf_counter())
        if delta.finish_reason is not None:
            done.add(delta.rid)

    for i in range(0, len(prompts), IN_FLIGHT):
        sent: dict[str, float] = {}
        for j, ids in enumerate(prompts[i : i + IN_FLIGHT]):
            rid = f"r{i + j}"
            sent[rid] = time.perf_counter()
            eng.submit(ids, params, sink, rid=rid)
        while not done.issuperset(sent):
            eng.step()
        ttft += [first[rid] - t for rid, t in sent.items()]
    eng.check_memory()
    return ttft


def replay_hit_rate(trace: Trace, policy: str, host: bool, hidden_size: int) -> float:
    """The trace through a capacity-limited cache with no model (a one-float KV per token): the
    share of prompt tokens a match found (a request's own reply is cached after it, as by the
    engine: fake tokens of its length)."""
    pool = trace.pool
    cfg = HiCacheConfig(
        enable_hierarchical_cache=host, hicache_ratio=HOST_RATIO, radix_eviction_policy=policy
    )
    longest = max(len(p) for p in trace.prompts) + OUTPUT_TOKENS + 1
    cm = CacheManager(
        ReqToTokenPool(2, longest, CPU),
        TokenToKVPoolAllocator(pool, CPU),
        hicache=cfg,
        kv_cache=KVCache(pool, 1, 1, 1, torch.float32, CPU),
        hidden_size=hidden_size,
    )
    hit = total = 0
    params = SamplingParams(max_new_tokens=OUTPUT_TOKENS)
    for n, ids in enumerate(trace.prompts):
        req = Req(f"r{n}", ids, params)
        cm.match_prefix(req)
        cm.lock(req)
        hit += len(req.prefix_indices)
        total += len(ids)
        cm.alloc_extend([req], [len(req.prefix_indices)], [req.extend_input_len])
        req.output_ids = [1] * (OUTPUT_TOKENS - 1)  # the reply's KV (its last token has none)
        rows = torch.tensor([req.req_pool_idx])
        for k in range(OUTPUT_TOKENS - 1):
            cm.alloc_decode([req], rows, torch.tensor([len(ids) + k]))
        cm.cache_finished_req(req)
    cm.check_idle()
    return hit / total


def plot(
    results: dict[str, dict[str, dict]], policies: dict[str, dict[str, dict[str, float]]], path: str
) -> None:
    """Per trace: TTFT p50/p90 and hit rate per engine; hit rate per eviction policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(next(iter(results.values())))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [t + k * width for t in range(len(traces))]
        axes[0].bar(
            xs, [1000 * results[t][name]["p50"] for t in traces], width, label=f"{name} p50"
        )
        axes[0].scatter(
            xs, [1000 * results[t][name]["p90"] for t in traces], marker="_", s=300, color="k"
        )
        axes[1].bar(xs, [100 * results[t][name]["hit"] for t in traces], width, label=name)
    for ax, title, unit in (
        (axes[0], "TTFT p50 (bars) and p90 (ticks)", "ms"),
        (axes[1], "hit rate", "%"),
    ):
        ax.set_xticks([t + width * (len(names) - 1) / 2 for t in range(len(traces))], traces)
        ax.set(title=title, ylabel=unit)
    rows = [(t, tier) for t in policies for tier in ("pool", "host")]
    width = 0.8 / len(POLICIES)
    for k, policy in enumerate(POLICIES):
        axes[2].bar(
            [r + k * width for r in range(len(rows))],
            [100 * policies[t][tier][policy] for t, tier in rows],
            width,
            label=policy,
        )
    axes[2].set_xticks(
        [r + width * (len(POLICIES) - 1) / 2 for r in range(len(rows))],
        [f"{t}\n{tier}" for t, tier in rows],
    )
    axes[2].set(title="eviction policies (replay, no model): hit rate", ylabel="%")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case_hicache(path: str, scale: float, plot_path: str | None = PLOT_PATH) -> None:
    model = ModelConfig.from_dir(path)
    vocab = model.vocab_size
    traces = [chat_trace(scale, vocab), churn_trace(scale, vocab)]
    results: dict[str, dict[str, dict]] = {}
    for trace in traces:
        results[trace.name] = {}
        with tempfile.TemporaryDirectory(prefix="radixray-hicache-") as storage_dir:
            for name, kw in engine_configs(storage_dir).items():
                eng = Engine(model_path=path, max_total_tokens=trace.pool, **kw)
                ttft = run_trace(eng, trace.prompts)
                stats = eng.stats()
                eng.shutdown()
                computed = stats.prompt_tokens - stats.cached_tokens
                r = results[trace.name][name] = {
                    "hit": stats.cached_tokens / stats.prompt_tokens,
                    "computed": computed,
                    "p50": percentile(ttft, 0.5),
                    "p90": percentile(ttft, 0.9),
                }
                tiers = ""
                if stats.hicache is not None:
                    h = stats.hicache
                    tiers = (
                        f", hits device/host/storage {h.device.hit_tokens}/{h.host.hit_tokens}/"
                        f"{h.storage.hit_tokens} tokens, host load {h.host.load_seconds * 1e3:.0f} ms"
                    )
                print(
                    f"hicache    {trace.name:5} {name:14}: hit {r['hit']:6.1%}, computed {computed:7,} of "
                    f"{stats.prompt_tokens:,} prompt tokens, TTFT p50 {1e3 * r['p50']:7.1f} ms, p90 "
                    f"{1e3 * r['p90']:7.1f} ms (pool {trace.pool:,} tokens, {len(trace.prompts)} requests{tiers})",
                    flush=True,
                )
                del eng
                gc.collect()
        base, host = results[trace.name]["pool only"], results[trace.name]["host tier"]
        line(
            "hicache",
            f"{trace.name} host tier",
            1e3 * host["p90"],
            "pool only",
            1e3 * base["p90"],
            "ms TTFT p90",
            f"(hit {host['hit']:.0%} vs {base['hit']:.0%})",
        )
    policies: dict[str, dict[str, dict[str, float]]] = {}
    for trace in [*traces, shift_trace(scale, vocab)]:  # the shift trace: replayed only
        policies[trace.name] = {}
        for tier, host in (("pool", False), ("host", True)):
            rates = policies[trace.name][tier] = {
                p: replay_hit_rate(trace, p, host, model.hidden_size) for p in POLICIES
            }
            print(
                f"hicache    policies {trace.name:5} {tier:4}: "
                + ", ".join(
                    f"{p} {rates[p]:6.1%} ({100 * (rates[p] - rates['lru']):+.1f})"
                    for p in POLICIES
                ),
                flush=True,
            )
    if plot_path:
        plot(results, policies, plot_path)
        print(f"hicache    plot: {plot_path}", flush=True)
