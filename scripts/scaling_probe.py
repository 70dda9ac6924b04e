"""How well do two engine *processes* scale on this machine, with no Ray in the way?

    python scripts/scaling_probe.py      # 1 process x 64 requests vs 2 processes x 32, 1 thread each

Separates the machine's limit (memory bandwidth shared by the cores) from the cluster's own
overhead when reading `python -m cluster.bench`'s `scale` line."""

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


def run(parts: list[tuple[int, int]]) -> float:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(parts)), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(a, b, barrier, out)) for a, b in parts]
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
