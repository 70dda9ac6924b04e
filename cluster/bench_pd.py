"""`python -m cluster.bench --cases pd`: prefill/decode disaggregation against unified engines.

The same offered load, side by side in one run, on 1 prefill + 1 decode engine and on 2 unified
engines (one CPU each, chunked prefill of 256 tokens on every engine): 8 streaming decodes (short
prompts, 600 output tokens) while sixteen 1,024-token prompts arrive 1.5 s apart, each a shared
256-token system prompt and 768 tokens of its own (about what one prefill engine computes in that
time here). On unified engines every long prompt's prefill shares the
engine's steps with the decodes there (chunk by chunk); on the decode engine of a disaggregated
pair a prompt arrives as KV and costs the decodes only its copy into the pool."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import uuid

from cluster import Cluster, ClusterConfig
from engine import SamplingParams
from engine.bench import BENCH_ARCH
from engine.bench_common import random_prompts

PD_CHUNK = 256  # chunked_prefill_size of every engine in the pd case


def percentile(xs: list[float], p: float) -> float:
    """The nearest-rank p-quantile (0 for no values); every cluster bench case reports with it."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else 0.0


def pd_workload(scale: float) -> dict:
    """Streams (prompt, output tokens) and long prompts (prompt, output tokens, arrival time)."""
    rng = random.Random(27)
    vocab = BENCH_ARCH["vocab_size"]
    streams, stream_out = max(2, int(8 * scale)), max(64, int(600 * scale))
    # A long prompt every 1.5 s, about what one prefill engine (one CPU) sustains at this length,
    # and often enough that each unified engine stalls its streams more than once per 100 tokens.
    longs, long_len = max(2, int(16 * scale)), max(320, int(1024 * scale))
    gap = 1.5 * max(scale, 0.25)
    # The long prompts open with one 256-token system prompt: both caches hold it after the first,
    # so the prefill computes, and the decode engine receives, only the rest.
    system = random_prompts(1, 256, 256, vocab, rng)[0]
    rest = random_prompts(longs, long_len - len(system), long_len - len(system), vocab, rng)
    return {"streams": [(p, stream_out) for p in random_prompts(streams, 48, 64, vocab, rng)],
            "longs": [(system + p, 16, 1.0 + i * gap) for i, p in enumerate(rest)]}


async def _one(cl: Cluster, ids: list[int], out: int, delay: float, t0: float, rec: dict) -> None:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    sent = time.perf_counter()
    times, tokens = [], 0
    params = SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)
    async for d in cl.stream_ids(ids, params, uuid.uuid4().hex):
        if d.error:
            raise RuntimeError(d.error)
        if d.token_ids:
            times.append(time.perf_counter())
            tokens += len(d.token_ids)
    assert tokens == out, f"skipped work: {tokens} of {out} tokens"
    rec["ttft"].append(times[0] - sent)
    rec["itl"].extend(b - a for a, b in zip(times, times[1:]))
    rec["tokens"] += tokens


def run_load(cfg: ClusterConfig, load: dict) -> dict:
    """Stream the workload through a Cluster; latency distributions, throughput and engine stats."""
    with Cluster(cfg) as cl:
        cl.generate(input_ids=[[7] * 16], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        streams = {"ttft": [], "itl": [], "tokens": 0}
        longs = {"ttft": [], "itl": [], "tokens": 0}

        async def everything() -> None:
            t0 = time.perf_counter()
            await asyncio.gather(*(_one(cl, p, n, 0.0, t0, streams) for p, n in load["streams"]),
                                 *(_one(cl, p, n, at, t0, longs) for p, n, at in load["longs"]))

        t0 = time.perf_counter()
        cl.run(everything())
        wall = time.perf_counter() - t0
        stats = cl.stats()
        cl.check_memory()
    engines = [s.engine for s in stats.engines]
    prompt_tokens = sum(len(p) for p, _, _ in load["longs"]) + sum(len(p) for p, _ in load["streams"])
    decode = [e for s, e in zip(stats.engines, engines) if s.role == "decode"]
    transfers = sum(e.kv_transfers for e in decode)
    return {"itl": streams["itl"], "ttft_stream": streams["ttft"], "ttft_long": longs["ttft"],
            "tokens_per_s": (streams["tokens"] + longs["tokens"]) / wall, "wall_s": wall,
            "transfers": transfers,
            "fetch_ms": 1000 * sum(e.kv_transfer_seconds for e in decode) / max(transfers, 1),
            "wire_ms": 1000 * sum(e.kv_wire_seconds for e in decode) / max(transfers, 1),
            "bytes_per_1k": sum(e.kv_transfer_bytes for e in decode) * 1000 / prompt_tokens,
            "skipped_tokens": sum(e.kv_skipped_tokens for e in decode),
            "bytes_per_token": sum(e.kv_transfer_bytes for e in decode) / max(sum(e.kv_transfer_tokens for e in decode), 1),
            "roles": [s.role for s in stats.engines]}


def _summary(r: dict) -> str:
    return (f"ITL p50={1000 * statistics.median(r['itl']):.0f} ms p99={1000 * percentile(r['itl'], 0.99):.0f} ms "
            f"p99.9={1000 * percentile(r['itl'], 0.999):.0f} ms max={1000 * max(r['itl']):.0f} ms  "
            f"TTFT stream p50={1000 * statistics.median(r['ttft_stream']):.0f} ms "
            f"long p50={1000 * statistics.median(r['ttft_long']):.0f} ms p99={1000 * percentile(r['ttft_long'], 0.99):.0f} ms  "
            f"out={r['tokens_per_s']:.1f} tok/s")


def plot(results: dict[str, dict], path: str) -> None:
    """ITL and TTFT distributions (CDFs) of both setups, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        for ax, key in zip(axes, ("itl", "ttft_long")):
            xs = sorted(1000 * x for x in r[key])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    axes[0].set(title="decode streams: inter-token latency", xlabel="ms", ylabel="fraction", xscale="log")
    axes[1].set(title="long prompts: time to first token", xlabel="ms", ylabel="fraction")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case_pd(path: str, scale: float, plot_path: str | None = None) -> None:
    load = pd_workload(scale)
    # Chunked prefill on every engine (both setups alike), as served engines run it: a long prompt
    # shares a unified engine's steps with its decodes a chunk at a time.
    base = dict(model_path=path, device="cpu", cpus_per_engine=1, torch_threads_per_engine=1, stream_interval_s=0.0,
                engine={"max_total_tokens": 32768, "chunked_prefill_size": PD_CHUNK})
    results = {"2 unified": run_load(ClusterConfig(num_engines=2, **base), load),
               "1 prefill + 1 decode": run_load(ClusterConfig(prefill_engines=1, decode_engines=1, **base), load)}
    uni, pd = results["2 unified"], results["1 prefill + 1 decode"]
    for name, r in results.items():
        print(f"pd         {name:<22} {_summary(r)}", flush=True)
    itl_ratio = percentile(pd["itl"], 0.99) / max(percentile(uni["itl"], 0.99), 1e-9)
    print(f"pd         ITL p99 ratio={itl_ratio:.2f}x (floor <= 0.5x)  throughput ratio="
          f"{pd['tokens_per_s'] / uni['tokens_per_s']:.2f}x (floor >= 0.8x)  transfers={pd['transfers']}: "
          f"{pd['wire_ms']:.1f} ms each from hand-over to in place ({pd['fetch_ms']:.0f} ms from fetch, the prefill "
          f"included), {pd['bytes_per_1k'] / 1e6:.2f} MB per 1,000 prompt tokens  "
          f"decode-side prefix hits saved {pd['skipped_tokens']} tokens "
          f"({pd['skipped_tokens'] * pd['bytes_per_token'] / 1e6:.1f} MB)", flush=True)
    if plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        plot(results, plot_path)
        print(f"pd         plot: {plot_path}", flush=True)
