"""`python -m engine.bench --cases dllm`: block diffusion (DLLM_EXTEND) on the built-in SDAR model
(`builtin-dllm`, blocks of 4) through the Engine: tokens per forward (output tokens committed per
request per DLLM_EXTEND forward: at most the block size, at least one block per block-size
forwards) and output tokens/s at batch 1 and 8 for LowConfidence thresholds 0.95, 0.5 and 0
(0 unmasks a whole block per forward). The built-in model's weights are random, so how confident
it is, and so the tokens per forward at 0.95 and 0.5, says nothing of a trained model; the
threshold-0 rows are the ceiling any model reaches."""

from __future__ import annotations

import gc
import random
import time

from engine.bench_common import line, random_prompts
from engine.engine import Engine
from engine.sampling import SamplingParams

MODEL = "builtin-dllm"
THRESHOLDS = (0.95, 0.5, 0.0)
BATCHES = (1, 8)


def dllm_rates(
    threshold: float, bs: int, prompt_len: int, out_len: int, rounds: int
) -> dict[str, float]:
    """One engine at `threshold`: `bs` requests of `prompt_len` random tokens and `out_len` new
    tokens each, the best of `rounds` timed runs after a warm-up -> tokens per forward (per
    request), forwards, output tok/s."""
    eng = Engine(
        model_path=MODEL,
        dllm_threshold=threshold,
        max_running_requests=max(BATCHES),
        max_total_tokens=max(BATCHES) * (prompt_len + out_len + 8) + 64,
    )
    vocab = eng.model_config.dllm_mask_token_id  # (the mask token is the last id)
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
    eng.generate(
        input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0)
    )
    best: dict[str, float] | None = None
    for r in range(rounds):
        prompts = random_prompts(bs, prompt_len, prompt_len, vocab, random.Random(r))
        dllm = eng.scheduler.dllm
        before = (dllm.forwards, dllm.request_forwards, dllm.committed_tokens)
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
        forwards, req_forwards, tokens = (
            a - b
            for a, b in zip((dllm.forwards, dllm.request_forwards, dllm.committed_tokens), before)
        )
        assert sum(len(o.token_ids) for o in outs) == tokens == bs * out_len
        run = {
            "tokens_per_forward": tokens / req_forwards,
            "forwards": forwards,
            "tok_s": tokens / seconds,
        }
        if best is None or run["tok_s"] > best["tok_s"]:
            best = run
    eng.check_memory()
    del eng
    gc.collect()
    return best


def case_dllm(path: str, scale: float) -> None:
    """`path` is not read: the case runs the built-in block-diffusion model."""
    out_len, rounds = (128, 2) if scale >= 1 else (max(16, int(128 * scale) // 4 * 4), 1)
    prompt_len = 32
    print(
        f"dllm       {MODEL} (blocks of 4), prompts of {prompt_len} tokens, {out_len} new tokens, "
        f"greedy LowConfidence; best of {rounds}",
        flush=True,
    )
    results: dict[tuple[float, int], dict[str, float]] = {}
    for bs in BATCHES:
        for t in THRESHOLDS:
            results[t, bs] = r = dllm_rates(t, bs, prompt_len, out_len, rounds)
            print(
                f"dllm       bs={bs} threshold={t:<4}: {r['tokens_per_forward']:4.2f} tokens/forward per request, "
                f"{r['forwards']:4.0f} forwards, {r['tok_s']:8.1f} tok/s",
                flush=True,
            )
        for t in THRESHOLDS[1:]:
            line(
                "dllm",
                f"bs={bs} threshold={t}",
                results[t, bs]["tok_s"],
                "threshold=0.95",
                results[0.95, bs]["tok_s"],
                "tok/s",
                f"({results[t, bs]['tokens_per_forward']:.2f} vs {results[0.95, bs]['tokens_per_forward']:.2f} "
                f"tokens/forward)",
            )
