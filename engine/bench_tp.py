"""The `tp` bench case: a tensor-parallel engine of two CPU ranks (one thread each: rank 0 in
this process, rank 1 in a spawned one) against one rank with two threads, decode tokens per
second at batch 1, 8 and 32, and the time per decode step spent in the TP group's collectives
(`TPGroup.collective_seconds`: the all-reduces and the logits' all-gather; `object_seconds`: the
step's broadcast). The per-GPU figure is an estimate, not a measurement: the collectives per
step times a small-message NCCL all-reduce latency on NVLink."""

from __future__ import annotations

import multiprocessing as mp
import random

import msgspec
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.bench_common import random_prompts

BATCHES = (1, 8, 32)
# A small-message NCCL all-reduce between two GPUs over NVLink: of the order of 10 us (latency
# bound; nccl-tests' published figures for 8 B to 64 KiB on H100 NVLink). An estimate.
NVLINK_ALL_REDUCE_S = 10e-6


def _rank1(engine_config: dict, init_method: str) -> None:
    torch.set_num_threads(1)
    from engine.tp.worker import run_worker

    run_worker(engine_config, 1, init_method, 120.0)


def _decode_rate(
    eng: Engine, bs: int, out_len: int, rng: random.Random
) -> tuple[float, dict[str, float]]:
    """Decode tokens per second at batch `bs` over the engine's DECODE steps only (whole steps:
    scheduling, forward, sampling, output), and the TP group's counters per decode step (the
    prefill's collectives are in the counters too: a step's share of them is small at out_len)."""
    prompts = random_prompts(bs, 16, 16, eng.model_config.vocab_size, rng)
    group = eng.model_runner.tp_group
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
    before = (
        eng.step_seconds["DECODE"],
        eng.step_count["DECODE"],
        group.collective_seconds,
        group.object_seconds,
        group.collective_calls,
    )
    eng.generate(input_ids=prompts, sampling_params=params)
    after = (
        eng.step_seconds["DECODE"],
        eng.step_count["DECODE"],
        group.collective_seconds,
        group.object_seconds,
        group.collective_calls,
    )
    seconds, steps, coll, obj, calls = (a - b for a, b in zip(after, before))
    steps = max(1, steps)
    return bs * steps / max(1e-9, seconds), {
        "collective_s": coll / steps,
        "object_s": obj / steps,
        "calls": calls / steps,
    }


def case_tp(path: str, scale: float) -> None:
    """TP=2 over two CPU ranks vs one rank of two threads (see the module docstring), eagerly and
    with CPU decode graphs (compiled at start-up), side by side."""
    for cpu_graph in ("off", "on"):
        _run_tp(path, scale, cpu_graph)


def _run_tp(path: str, scale: float, cpu_graph: str) -> None:
    out_len = max(16, int(64 * scale))
    base = dict(
        model_path=path,
        device="cpu",
        max_total_tokens=16384,
        max_running_requests=max(BATCHES),
        cpu_graph=cpu_graph,
    )
    threads = torch.get_num_threads()
    one = Engine(**base, torch_threads=2)
    one.generate(
        input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0)
    )
    rng = random.Random(32)
    rates_one = {bs: _decode_rate(one, bs, out_len, rng)[0] for bs in BATCHES}
    layers = one.model_config.num_hidden_layers
    one.shutdown()
    del one

    from engine.tp.comm import serve_store
    from engine.tp.worker import rank0_engine

    config = EngineConfig.from_kwargs(**base, torch_threads=1, tp_size=2)
    store, init = serve_store("127.0.0.1", config.tp_size, timeout_s=120.0)
    proc = mp.get_context("spawn").Process(
        target=_rank1, args=(msgspec.structs.asdict(config), init), daemon=True
    )
    proc.start()
    tp = rank0_engine(config, store, timeout_s=120.0)
    try:
        tp.generate(
            input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0)
        )
        rng = random.Random(32)
        for bs in BATCHES:
            rate, per_step = _decode_rate(tp, bs, out_len, rng)
            estimate = per_step["calls"] * NVLINK_ALL_REDUCE_S
            print(
                f"tp         graphs={cpu_graph} bs={bs:<3} one rank x2 threads={rates_one[bs]:,.1f} tok/s  "
                f"tp=2 x1 thread={rate:,.1f} tok/s  ratio={rate / rates_one[bs]:.2f}x  "
                f"collectives={per_step['collective_s'] * 1e3:.2f} ms/step ({per_step['calls']:.0f} calls, "
                f"{layers} layers)  broadcast={per_step['object_s'] * 1e3:.2f} ms/step  "
                f"NVLink estimate (not measured)={estimate * 1e3:.2f} ms/step",
                flush=True,
            )
    finally:
        tp.shutdown()
        proc.join(30)
        torch.set_num_threads(threads)

