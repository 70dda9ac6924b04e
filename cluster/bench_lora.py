"""`python -m cluster.bench --cases lora`: many LoRA adapters over two engines, routed with
adapter affinity (`kv_events`: an engine holding the adapter is preferred, the cost of reading
it scored with the cache match and load) vs round robin (every engine sees every adapter):
throughput, adapters read again from their files after an eviction, copies into device slots."""

from __future__ import annotations

import random
import tempfile
import time

from cluster import Cluster, ClusterConfig
from engine import SamplingParams
from engine.bench_lora import write_adapters
from engine.config import ModelConfig

ADAPTERS = 16
PROMPT_TOKENS = 32
NEW_TOKENS = 32
# Each engine keeps 8 adapters in host memory (half of them) and 4 in device slots: with affinity
# each engine can keep its share resident; dealt round robin, each meets all 16.
LORA_ENGINE = dict(enable_lora=True, max_loras_per_batch=4, max_loaded_loras=8, max_lora_rank=16,
                   lora_target_modules="all", max_total_tokens=16384)


# label -> (policy, routing_options): kv_events at its default adapter cost and a lighter one.
POLICIES = {"kv_events": ("kv_events", {}), "kv_events cost 16": ("kv_events", {"lora_load_cost": 16.0}),
            "round_robin": ("round_robin", {})}


def run_policy(path: str, policy: str, options: dict[str, float], adapters: dict[str, str],
               prompts: list[list[int]], names: list[str]) -> dict[str, float]:
    cfg = ClusterConfig(model_path=path, num_engines=2, routing=policy, routing_options=options, device="cpu",
                        cpus_per_engine=1, torch_threads_per_engine=1, engine=LORA_ENGINE)
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for _ in prompts]
    with Cluster(cfg) as cl:
        for name, folder in adapters.items():
            cl.load_lora_adapter(name, folder)
        before = [s.engine for s in cl.stats().engines]
        t0 = time.perf_counter()
        results = cl.generate(input_ids=prompts, sampling_params=params, lora_name=names)
        dt = time.perf_counter() - t0
        assert all(len(r.token_ids) == NEW_TOKENS and r.error is None for r in results), "a request skipped work"
        stats = cl.stats()
        cl.check_memory()
    after = [s.engine for s in stats.engines]
    return {"tok_s": len(prompts) * NEW_TOKENS / dt,
            "reloads": sum(a.lora_host_reloads - b.lora_host_reloads for a, b in zip(after, before)),
            "slot_loads": sum(a.lora_slot_loads - b.lora_slot_loads for a, b in zip(after, before)),
            "warm": stats.routing.lora_warm, "cold": stats.routing.lora_cold}


def case_lora(path: str, scale: float) -> None:
    rng = random.Random(0)
    n = max(32, int(256 * scale))
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = [[1] + [rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
    with tempfile.TemporaryDirectory() as root:
        adapters = write_adapters(root, ModelConfig.from_dir(path), ADAPTERS)
        names = [rng.choice(sorted(adapters)) for _ in range(n)]
        results = {label: run_policy(path, policy, options, adapters, prompts, names)
                   for label, (policy, options) in POLICIES.items()}
    print(f"lora       2 engines, {ADAPTERS} adapters (rank 16, every projection), {n} requests naming one at "
          f"random, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, all sent at once; per engine "
          f"max_loaded_loras={LORA_ENGINE['max_loaded_loras']}, max_loras_per_batch="
          f"{LORA_ENGINE['max_loras_per_batch']}", flush=True)
    for policy, r in results.items():
        print(f"lora       {policy:<17} {r['tok_s']:8,.1f} out tok/s  adapters read again {r['reloads']:4d}  "
              f"slot loads {r['slot_loads']:4d}  routed to a holder {r['warm']}, elsewhere {r['cold']}", flush=True)
    b = results["round_robin"]
    for label in ("kv_events", "kv_events cost 16"):
        a = results[label]
        print(f"lora       {label}={a['tok_s']:,.1f} tok/s  round_robin={b['tok_s']:,.1f} tok/s  "
              f"ratio={a['tok_s'] / b['tok_s']:.2f}x  reloads {a['reloads']} vs {b['reloads']}", flush=True)
