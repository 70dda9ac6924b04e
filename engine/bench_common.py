"""What the engine benchmarks share: random prompts, timed engine runs, the one-line comparison
format, this machine's read bandwidth and last-level cache, and decode rates of several engine
configurations measured in alternating rounds."""

from __future__ import annotations

import gc
import random
import time

import torch

from engine import Engine, SamplingParams


def random_prompts(n: int, lo: int, hi: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(eng: Engine, prompts: list[list[int]], outs: list[int]) -> float:
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    t0 = time.perf_counter()
    results = eng.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    assert [len(r.token_ids) for r in results] == outs, "engine skipped work"
    eng.check_memory()
    return dt


def line(case: str, a_name: str, a: float, b_name: str, b: float, unit: str, extra: str = "") -> None:
    print(f"{case:<10} {a_name}={a:,.1f} {unit}  {b_name}={b:,.1f} {unit}  ratio={a / b:.2f}x {extra}".rstrip(),
          flush=True)


GREEDY_WARMUP = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def llc_bytes() -> int:
    """The largest cache of CPU 0 (sysfs: the last level), or 32 MiB when sysfs says nothing."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def read_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` bytes/s reading a float32 buffer of `nbytes` once: a torch reduction and
    the project's C++ streaming read with every thread."""
    from kernels import cpu_kernels

    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    out = {"torch_sum": buf.numel() * 4 / best}
    del buf
    if cpu_kernels.load() is not None:
        out["cpp_stream"] = cpu_kernels.stream_read_bandwidth(nbytes, repeats)
    return out


def decode_rates(path: str, bs: int, out_len: int, rounds: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Per config (engine kwargs), one engine; `rounds` alternating runs of bs requests (128-token
    prompts, out_len greedy tokens each, new prompts every run), so that a busy machine's stalls
    hit runs, not one side: best decode tok/s and ms/step, best prefill tok/s, compile seconds."""
    rng = random.Random(9)
    engines = {name: Engine(model_path=path, max_total_tokens=16384, max_running_requests=bs, **kw)
               for name, kw in configs.items()}
    vocab = next(iter(engines.values())).model_config.vocab_size
    out = {}
    for name, eng in engines.items():  # warm-up (the graphs compiled when the engine started)
        eng.generate(input_ids=random_prompts(bs, 128, 128, vocab, rng), sampling_params=GREEDY_WARMUP)
        graphs = eng.model_runner.graph_runner
        out[name] = {"decode": 0.0, "step_ms": float("inf"), "forward_ms": float("inf"), "prefill": 0.0,
                     "compile_s": sum(graphs.compile_seconds.values()) if graphs is not None else 0.0,
                     "compiled": len(graphs.compile_seconds) if graphs is not None else 0}
        if graphs is not None and getattr(graphs, "failed", None):
            print(f"roofline   {name}: graphs failed to compile: {graphs.failed}", flush=True)
    for _ in range(rounds):
        prompts = random_prompts(bs, 128, 128, vocab, rng)
        for name, eng in engines.items():
            eng.step_seconds.clear()
            eng.step_count.clear()
            eng.scheduler.forward_seconds.clear()
            run_engine(eng, prompts, [out_len] * bs)  # (each engine its own cache: no hits)
            steps, secs = eng.step_count["DECODE"], eng.step_seconds["DECODE"]
            best = out[name]
            best["decode"] = max(best["decode"], bs * steps / secs)
            best["step_ms"] = min(best["step_ms"], 1e3 * secs / steps)
            best["forward_ms"] = min(best["forward_ms"], 1e3 * eng.scheduler.forward_seconds["DECODE"] / steps)
            best["prefill"] = max(best["prefill"], 128 * bs / eng.step_seconds["EXTEND"])
    del engines
    gc.collect()
    return out
