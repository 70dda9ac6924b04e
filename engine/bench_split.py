"""`python -m engine.bench --cases split`: one stream decodes while a 1,000-token and then a
4,000-token prompt arrive, on the bench model (its weights, an 8,192-token context). Three engines
side by side, in alternating rounds: unsplit (each prompt one EXTEND forward), chunked prefill
(512-token chunks) and split prefill (`enable_split_prefill`, the default budget: the long prompt
one layer per step, the shorter one four). Per engine: the stream's longest inter-token gap (the
best round's: a busy machine only adds gaps) and p99 ITL (every round's gaps), each prompt's time
to first token (best round), and prefill throughput: the prompts' tokens over the seconds their
forwards took (EXTEND and SPLIT_PREFILL forwards after the stream started; decode forwards not
counted). Floors: split's longest gap at most 0.5x unsplit's, its prefill throughput at least
0.9x. The ITL distributions and the TTFTs go to a PNG."""

from __future__ import annotations

import gc
import json
import os
import random
import time

from engine.bench_common import GREEDY_WARMUP, line, random_prompts
from engine.builtin_model import cached_random_checkpoint
from engine.config import EngineConfig
from engine.engine import Engine, StreamDelta
from engine.sampling import SamplingParams

CONFIGS = {
    "unsplit": {},
    "chunked 512": {"chunked_prefill_size": 512},
    "split": {"enable_split_prefill": True},
}
CONTEXT = 8192
PLOT_PATH = "docs/images/split_itl.png"


def long_context_model(path: str) -> str:
    """The checkpoint at `path` (a random bench model) rebuilt with an 8,192-token context: the
    same seed and shapes, so the same weights."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = {**json.load(f), "max_position_embeddings": CONTEXT}
    return cached_random_checkpoint(f"{os.path.basename(path)}-ctx{CONTEXT}", cfg, std=0.02)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_round(
    eng: Engine,
    prompt_lens: tuple[int, ...],
    stream_tokens: int,
    arrive_at: tuple[int, ...],
    rng: random.Random,
) -> dict:
    """The stream, with each prompt submitted once the stream has `arrive_at[i]` tokens; stepped
    here until all end. Returns the stream's gaps (s), each prompt's TTFT (s) and the prefill
    forward seconds."""
    vocab = eng.model_config.vocab_size
    stamps: list[float] = []  # one per stream token
    first: dict[str, float] = {}

    def stream_sink(delta: StreamDelta) -> None:
        stamps.extend([time.perf_counter()] * len(delta.token_ids))

    def prompt_sink(delta: StreamDelta) -> None:
        first.setdefault(delta.rid, time.perf_counter())

    eng.submit(
        random_prompts(1, 64, 64, vocab, rng)[0],
        SamplingParams(max_new_tokens=stream_tokens, temperature=0.0, ignore_eos=True),
        stream_sink,
    )
    while not stamps:
        eng.step()
    eng.scheduler.forward_seconds.clear()
    submitted: dict[str, float] = {}
    pending = list(zip(prompt_lens, arrive_at))
    while eng.step() or pending:
        while pending and len(stamps) >= pending[0][1]:
            n, _ = pending.pop(0)
            rid = f"prompt{n}-{rng.getrandbits(32)}"
            submitted[rid] = time.perf_counter()
            eng.submit(
                random_prompts(1, n, n, vocab, rng)[0],
                SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                prompt_sink,
                rid=rid,
            )
    assert len(stamps) == stream_tokens, "the stream stopped early"
    eng.check_memory()
    fs = eng.scheduler.forward_seconds
    return {
        "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
        "ttft": {rid.split("-")[0]: first[rid] - t for rid, t in submitted.items()},
        "prefill_s": fs["EXTEND"] + fs["SPLIT_PREFILL"] + fs["MIXED"],
    }


def plot(results: dict[str, dict], path: str) -> None:
    """The stream's ITL distribution (CDF) and each prompt's TTFT, per engine, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        xs = sorted(1000 * x for x in r["gaps"])
        axes[0].step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    axes[0].set(
        title="decoding stream: inter-token latency", xlabel="ms", ylabel="fraction", xscale="log"
    )
    prompts = sorted(
        next(iter(results.values()))["ttft"], key=lambda k: int(k.removeprefix("prompt"))
    )
    width = 0.8 / len(results)
    for i, (name, r) in enumerate(results.items()):
        axes[1].bar(
            [j + i * width for j in range(len(prompts))],
            [1000 * r["ttft"][p] for p in prompts],
            width,
            label=name,
        )
    axes[1].set_xticks(
        [j + width * (len(results) - 1) / 2 for j in range(len(prompts))],
        [f"{p.removeprefix('prompt')} tokens" for p in prompts],
    )
    axes[1].set(title="arriving prompts: time to first token", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case_split(path: str, scale: float, plot_path: str | None = PLOT_PATH) -> None:
    model = long_context_model(path)
    prompt_lens = (max(16, int(1000 * scale)), max(64, int(4000 * scale)))
    stream_tokens, arrive_at = (
        max(40, int(240 * scale)),
        (max(4, int(40 * scale)), max(16, int(140 * scale))),
    )
    rounds = 2 if scale >= 1 else 1
    rng = random.Random(29)
    configs = dict(CONFIGS)
    if scale < 1:  # shorter prompts: a budget scaled alike, so that they are still split
        budget = max(64, int(EngineConfig().split_forward_token_budget * scale))
        configs["split"] = {**configs["split"], "split_forward_token_budget": budget}
    engines = {
        name: Engine(model_path=model, max_total_tokens=16384, max_running_requests=8, **kw)
        for name, kw in configs.items()
    }
    vocab = next(iter(engines.values())).model_config.vocab_size
    for eng in engines.values():
        eng.generate(
            input_ids=random_prompts(2, 600, 600, vocab, rng), sampling_params=GREEDY_WARMUP
        )
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(rounds):
        for (
            name,
            eng,
        ) in engines.items():  # alternating: a slow spell of the machine hits every engine
            runs[name].append(run_round(eng, prompt_lens, stream_tokens, arrive_at, rng))
    splits = engines["split"].stats().batches_by_mode["SPLIT_PREFILL"]
    assert splits >= 2 * rounds, (
        f"the split engine split {splits} prefills, expected both prompts' every round"
    )
    del engines
    gc.collect()
    results = {}
    for name, rs in runs.items():
        results[name] = r = {
            "gaps": [g for x in rs for g in x["gaps"]],
            "longest": min(max(x["gaps"]) for x in rs),
            "ttft": {p: min(x["ttft"][p] for x in rs) for p in rs[0]["ttft"]},
            "prefill": max(sum(prompt_lens) / x["prefill_s"] for x in rs),
        }
        ttft = ", ".join(
            f"{p.removeprefix('prompt')} tokens {1000 * t:,.0f} ms"
            for p, t in sorted(r["ttft"].items(), key=lambda kv: int(kv[0].removeprefix("prompt")))
        )
        print(
            f"split      {name:<12} longest gap {1000 * r['longest']:8.1f} ms, p99 ITL "
            f"{1000 * percentile(r['gaps'], 0.99):7.1f} ms, median ITL {1000 * percentile(r['gaps'], 0.5):6.1f} ms; "
            f"TTFT {ttft}; prefill {r['prefill']:8,.0f} tok/s",
            flush=True,
        )
    un, sp = results["unsplit"], results["split"]
    line(
        "split",
        "split longest gap",
        1000 * sp["longest"],
        "unsplit",
        1000 * un["longest"],
        "ms",
        "(floor <= 0.5x)",
    )
    line(
        "split",
        "split prefill",
        sp["prefill"],
        "unsplit",
        un["prefill"],
        "tok/s",
        "(floor >= 0.9x)",
    )
    if plot_path:
        plot(results, plot_path)
        print(f"split      plot: {plot_path}", flush=True)
