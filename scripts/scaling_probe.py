"""How well do two engine *processes* scale on this machine, with no Ray in the way?

    python scripts/scaling_probe.py      # 1 process x 64 requests vs 2 processes x 32, 1 thread each

Separates what two engines can reach on this machine from the cluster's own overhead when
reading `python -m cluster.bench`'s `scale` line. A control line runs the same number of
batch-64 GEMMs over a 64 MB weight (streamed from memory) in one process vs two: it shows
whether the cores slow each other down."""

from __future__ import annotations

import multiprocessing as mp
import time


def worker(start: int, stop: int, barrier, out) -> None:
    import torch

    torch.set_num_threads(1)
    from cluster.bench import mixed_workload
    from engine import Engine, SamplingParams
    from engine.bench import bench_model_path

    prompts, outs = mixed_workload(1.0)
    eng = Engine(model_path=bench_model_path(), max_total_tokens=65536, torch_threads=1)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in outs[start:stop]]
    barrier.wait()
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts[start:stop], sampling_params=params)
    out.put((sum(outs[start:stop]), time.perf_counter() - t0))


def gemm_worker(start: int, stop: int, barrier, out) -> None:
    import torch

    torch.set_num_threads(1)
    x, w = torch.randn(64, 4096), torch.randn(4096, 4096)
    for _ in range(3):
        x @ w
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(stop - start):
        x @ w
    out.put((stop - start, time.perf_counter() - t0))


def run(parts: list[tuple[int, int]], target=worker) -> float:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(parts)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(a, b, barrier, out)) for a, b in parts]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in results) / max(dt for _, dt in results)


if __name__ == "__main__":
    one = run([(0, 64)])
    two = run([(0, 32), (32, 64)])
    print(f"probe      2_processes={two:,.1f} out tok/s  1_process={one:,.1f} out tok/s  ratio={two / one:.2f}x "
          "(no Ray; 1 torch thread each)", flush=True)
    one, two = run([(0, 200)], gemm_worker), run([(0, 100), (100, 200)], gemm_worker)
    print(f"control    2_processes={two:,.1f} gemm/s  1_process={one:,.1f} gemm/s  ratio={two / one:.2f}x "
          "(64x4096 @ 4096x4096 fp32, 1 thread each)", flush=True)
