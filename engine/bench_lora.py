"""`python -m engine.bench --cases lora`: batch-32 decode with 0, 1, 8 and 32 distinct LoRA adapters
on the bench model, side by side in one run (issue 31).

The case writes 32 PEFT adapters (adapter_config.json + adapter_model.safetensors, rank 16, every
attention and MLP projection: q, k, v, o, gate, up, down; small random A and B, float32) into a
temporary folder, then times `Engine.load_lora_adapter` for each of them on an engine started with
`enable_lora` (the host load: read, validate, convert; the copy into a device slot happens at the
adapter's first batch): load time per MB of adapter files (they were just written, so they are read
from the page cache).

Decode: 32 requests of random prompts, greedy, `ignore_eos`, all running in one batch
(`max_running_requests=32`; `max_loras_per_batch=32`, so the 32-adapter case fits one batch). With
n adapters request i names adapter i mod n (round robin: every decode batch mixes all n, and
neighbouring rows never share one, so each row is its own SGMV segment); n = 0 is the base model
(`lora_name=None`) on the same engine. A plain engine without LoRA ("lora off") runs the same prompts
as the base rows: its output must be the same, token for token. Per configuration: decode tok/s and
ms per decode step (DECODE steps only), the best of alternating rounds (a busy machine's stalls hit
rounds, not one side), and the ratio to the base rows. Floors: 8 adapters >= 0.75x the base model's
tok/s, 32 adapters >= 0.6x. The tok/s per adapter count goes to a PNG.

The SGMV kernel is the one `kernels.lora.sgmv` picks for the engine's device (Triton on CUDA, the C++
operator on the CPU where it is built, else the torch reference); the engine has no switch to run the
torch path beside the C++ one, so the case does not compare them."""

from __future__ import annotations

import gc
import json
import os
import random
import tempfile
import time

import torch
from safetensors.torch import save_file

from engine.bench_common import GREEDY_WARMUP, line, random_prompts
from engine.config import ModelConfig
from engine.engine import Engine
from engine.lora.adapter import TARGET_MODULES, target_shapes
from engine.sampling import SamplingParams
from kernels import cpu_kernels

COUNTS = (0, 1, 8, 32)  # distinct adapters per batch; 0: the base model
BATCH = 32
RANK = 16
ALPHA = 32
FLOORS = {8: 0.75, 32: 0.6}
PLOT_PATH = "docs/images/lora_throughput.png"
OFF = "lora off"
_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


def write_adapters(root: str, model: ModelConfig, n: int, rank: int = RANK) -> dict[str, str]:
    """`n` PEFT adapters for `model` (every target projection of every layer, rank `rank`, small
    random weights, float32) under `root`: name -> folder."""
    shapes = target_shapes(model)
    folders = {}
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(model.num_hidden_layers):
            for target in TARGET_MODULES:
                d_in, d_out = shapes[target]
                sub = "self_attn" if target in _ATTENTION else "mlp"
                key = f"base_model.model.model.layers.{layer}.{sub}.{target}"
                # std 0.02 for both (PEFT's default B is zero, which would make every update 0)
                tensors[f"{key}.lora_A.weight"] = 0.02 * torch.randn(rank, d_in, generator=g)
                tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(d_out, rank, generator=g)
        folder = os.path.join(root, f"lora{i}")
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": ALPHA,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(TARGET_MODULES),
            "base_model_name_or_path": None,
        }
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
        folders[f"lora{i}"] = folder
    return folders


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def adapter_names(n: int, batch: int = BATCH) -> list[str | None]:
    """Request i's adapter with n distinct adapters: round robin (None for every request if n == 0)."""
    return [None if n == 0 else f"lora{i % n}" for i in range(batch)]


def timed_decode(
    eng: Engine, prompts: list[list[int]], names: list[str | None], out_len: int
) -> dict:
    """One batch of `prompts` (request i under adapter names[i]), `out_len` greedy tokens each ->
    decode tok/s, ms per decode step and the output tokens. Every request must decode in every
    DECODE step (the batch ran as one)."""
    for counter in (eng.step_seconds, eng.step_count, eng.scheduler.forward_seconds):
        counter.clear()
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
    outs = eng.generate(input_ids=prompts, sampling_params=params, lora_name=names)
    for o in outs:
        assert o.error is None, o.error
        assert len(o.token_ids) == out_len, "engine skipped work"
    steps, secs = eng.step_count["DECODE"], eng.step_seconds["DECODE"]
    assert steps == out_len - 1, f"{len(prompts)} requests took {steps} decode steps, not one batch"
    eng.check_memory()
    return {
        "tok_s": len(prompts) * steps / secs,
        "step_ms": 1e3 * secs / steps,
        "tokens": [o.token_ids for o in outs],
    }


def sgmv_kernel(eng: Engine) -> str:
    """The SGMV implementation `kernels.lora.sgmv` runs for this engine's device."""
    device = eng.model_runner.device
    if device.type == "cuda":
        return "Triton (kernels/triton_lora.py)"
    if device.type == "cpu" and cpu_kernels.load() is not None:
        return "C++ (kernels/csrc/lora.cpp)"
    return "torch reference (sgmv_torch)"


def _label(n: int) -> str:
    return f"{n} adapter{'' if n == 1 else 's'}"


def plot(results: dict, path: str) -> None:
    """Decode tok/s per adapter count (the floors marked) and ms per decode step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [OFF] + [_label(n) if n else "base (0)" for n in COUNTS]
    keys = [OFF, *COUNTS]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["0.6"] + ["C0"] * len(COUNTS)
    axes[0].bar(labels, [results[k]["tok_s"] for k in keys], color=colors)
    base = results[0]["tok_s"]
    for k, n in enumerate(keys):
        if n in FLOORS:
            axes[0].hlines(FLOORS[n] * base, k - 0.4, k + 0.4, colors="C3", linestyles="--")
    axes[0].set(title=f"batch-{BATCH} decode (dashed: floor vs base)", ylabel="output tok/s")
    axes[1].bar(labels, [results[k]["step_ms"] for k in keys], color=colors)
    axes[1].set(title="time per decode step", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case_lora(path: str, scale: float, plot_path: str | None = PLOT_PATH) -> dict:
    """Prints the case's lines; returns {OFF or adapter count: {tok_s, step_ms}, "load": {...},
    "base_tokens" / "off_tokens": per round, the base rows' outputs and the plain engine's}."""
    with tempfile.TemporaryDirectory(prefix="radixray-lora-bench-") as root:
        # (the folders stay until the end: an engine reads an evicted adapter again from its path)
        return _run(path, scale, plot_path, root)


def _run(path: str, scale: float, plot_path: str | None, root: str) -> dict:
    model = ModelConfig.from_dir(path)
    n_adapters = max(COUNTS)
    prompt_len, out_len = max(8, int(64 * scale)), max(8, int(128 * scale))
    rounds = 3 if scale >= 1 else 1
    rng = random.Random(31)
    t0 = time.perf_counter()
    folders = write_adapters(root, model, n_adapters)
    t_write = time.perf_counter() - t0
    kw = dict(model_path=path, max_total_tokens=16384, max_running_requests=BATCH)
    eng = Engine(
        **kw,
        enable_lora=True,
        max_loras_per_batch=n_adapters,
        max_loaded_loras=n_adapters,
        max_lora_rank=RANK,
        lora_target_modules="all",
    )
    plain = Engine(**kw)
    sizes, times = [], []
    for name, folder in folders.items():
        sizes.append(folder_bytes(folder))
        t0 = time.perf_counter()
        eng.load_lora_adapter(name, folder)
        times.append(time.perf_counter() - t0)
    mb = sum(sizes) / 1e6
    load = {
        "adapters": len(times),
        "mb": mb,
        "seconds": sum(times),
        "ms_per_mb": 1e3 * sum(times) / mb,
        "mb_per_s": mb / sum(times),
    }
    print(
        f"lora       {model.num_hidden_layers} layers, rank {RANK} on {', '.join(TARGET_MODULES)}: "
        f"{sizes[0] / 1e6:.2f} MB per adapter file (float32; {n_adapters} written in {t_write:.1f} s); "
        f"batch {BATCH}, {prompt_len}-token prompts, {out_len} new tokens, best of {rounds}; "
        f"max_loras_per_batch={n_adapters}: all {n_adapters} adapters in one batch; SGMV: "
        f"{sgmv_kernel(eng)}; {eng.model_runner.device}, {eng.model_runner.dtype}",
        flush=True,
    )
    print(
        f"lora       load_lora_adapter: {len(times)} adapters, {mb:.1f} MB in {sum(times):.3f} s: "
        f"{load['ms_per_mb']:.2f} ms/MB ({load['mb_per_s']:,.0f} MB/s; per adapter median "
        f"{1e3 * sorted(times)[len(times) // 2]:.1f} ms, max {1e3 * max(times):.1f} ms; host load, "
        f"files in the page cache)",
        flush=True,
    )
    vocab = model.vocab_size
    # Warm-up: every adapter into its device slot, both engines' first forwards.
    eng.generate(
        input_ids=random_prompts(BATCH, prompt_len, prompt_len, vocab, rng),
        sampling_params=GREEDY_WARMUP,
        lora_name=adapter_names(n_adapters),
    )
    for e in (eng, plain):
        e.generate(
            input_ids=random_prompts(BATCH, prompt_len, prompt_len, vocab, rng),
            sampling_params=GREEDY_WARMUP,
        )
    best: dict = {k: {"tok_s": 0.0, "step_ms": float("inf")} for k in (OFF, *COUNTS)}
    base_tokens, off_tokens = [], []
    for _ in range(rounds):
        # Fresh prompts per run (no prefix hits), except that the plain engine and the base rows
        # share theirs (their outputs are compared).
        shared = random_prompts(BATCH, prompt_len, prompt_len, vocab, rng)
        for key in (OFF, *COUNTS):
            if key == OFF:
                r = timed_decode(plain, shared, adapter_names(0), out_len)
                off_tokens.append(r["tokens"])
            elif key == 0:
                r = timed_decode(eng, shared, adapter_names(0), out_len)
                base_tokens.append(r["tokens"])
            else:
                prompts = random_prompts(BATCH, prompt_len, prompt_len, vocab, rng)
                r = timed_decode(eng, prompts, adapter_names(key), out_len)
            best[key]["tok_s"] = max(best[key]["tok_s"], r["tok_s"])
            best[key]["step_ms"] = min(best[key]["step_ms"], r["step_ms"])
    in_slots = len(eng.model_runner.lora_manager.slots())
    assert in_slots == n_adapters, f"{in_slots} adapters in device slots, expected {n_adapters}"
    eng.shutdown()
    plain.shutdown()
    del eng, plain
    gc.collect()
    same = base_tokens == off_tokens
    base = best[0]
    for key in (OFF, *COUNTS):
        r = best[key]
        label = OFF if key == OFF else (_label(key) if key else "0 adapters (base)")
        print(
            f"lora       {label:<18}: {r['tok_s']:9,.1f} tok/s  {r['step_ms']:7.2f} ms/step  "
            f"{r['tok_s'] / base['tok_s']:.2f}x base",
            flush=True,
        )
    line(
        "lora",
        "base_rows",
        base["tok_s"],
        "lora_off",
        best[OFF]["tok_s"],
        "decode tok/s",
        f"(the LoRA engine's base-model rows vs a plain engine; same output tokens: {same})",
    )
    for n in COUNTS[1:]:
        floor = f"floor >= {FLOORS[n]}x; " if n in FLOORS else ""
        line(
            "lora",
            f"{n}_adapters",
            best[n]["tok_s"],
            "base",
            base["tok_s"],
            "decode tok/s",
            f"({floor}{best[n]['step_ms']:.2f} vs {base['step_ms']:.2f} ms/step; {n} distinct "
            f"adapter{'s' if n > 1 else ''} in every batch of {BATCH})",
        )
    print(
        "lora       sgmv C++ vs torch: not run (no engine switch: kernels.lora.sgmv takes the C++ "
        "operator whenever it is built; RADIXRAY_CPU_KERNELS=0 turns off every C++ kernel)",
        flush=True,
    )
    if plot_path:
        plot(best, plot_path)
        print(f"lora       plot: {plot_path}", flush=True)
    assert same, "the base-model rows' output differs from the plain engine's"
    return {**best, "load": load, "base_tokens": base_tokens, "off_tokens": off_tokens}
