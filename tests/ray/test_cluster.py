"""The Ray cluster: engine actors, routing, faults. Real Ray, CPU."""

from __future__ import annotations

import random
import shutil
import time

import pytest
import ray

from actors.protocol import GenerateRequest, decode_delta, encode
from cluster import Cluster, ClusterConfig
from engine import Engine, SamplingParams
from engine.errors import ConfigError
from tests.helpers import finals_after

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster_configs(model_dirs) -> dict[str, ClusterConfig]:
    # One round-robin pair for the match test and the fault test (which ends it restarted and
    # settled): quick health checks, requests bounded well above what a restart takes.
    return {"stories": ClusterConfig(model_path=model_dirs["stories"], num_engines=2, routing="round_robin",
                                     request_timeout_s=120, health_check_period_s=0.5)}


def test_two_engines_match_single_engine(clusters):
    cl = clusters.get("stories")
    prompts = ["Once upon a time", "The cat sat", "Lily had a red ball", "Tom and Sue went", "It was a sunny day",
               "The little dog", "One day, a bird", "Mom said"]
    ref = Engine(model_path=cl.config.model_path).generate(prompt=prompts, sampling_params=GREEDY)
    before = cl.stats()
    outs = cl.generate(prompt=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.text for o in outs] == [r.text for r in ref]
    stats = cl.stats()
    assert [a.engine.generated_tokens > b.engine.generated_tokens
            for a, b in zip(stats.engines, before.engines)] == [True, True]
    assert [a - b for a, b in zip(stats.routing.decisions, before.routing.decisions)] == [4, 4]
    assert all(a.healthy and a.engine.batches_by_mode["DECODE"] > b.engine.batches_by_mode["DECODE"]
               for a, b in zip(stats.engines, before.engines))
    # The actor's own per-request stream (a Ray streaming generator) gives the same tokens.
    ids = cl.inputs.tokenize(prompt=prompts[0])
    gen = cl.actors[1].generate.remote(encode(GenerateRequest(rid="direct-1", input_ids=ids,
                                                              sampling_params=GREEDY)))
    deltas = [decode_delta(ray.get(ref)) for ref in gen]
    assert [t for d in deltas for t in d.token_ids] == ref[0].token_ids
    assert deltas[-1].finish_reason == "length" and len(deltas) == len(ref[0].token_ids)
    for s in cl.check_memory():
        assert s.kv_used == 0


def _tenant_workload(n_tenants: int = 7, per: int = 4, prefix_len: int = 200, seed: int = 0):
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(5, 500) for _ in range(prefix_len)] for _ in range(n_tenants)]
    # Interleaved: every wave has one request of each tenant.
    return [[prefixes[t] + [rng.randrange(5, 500) for _ in range(8)] for t in range(n_tenants)] for _ in range(per)]


def _hit_rate(policy: str, path: str) -> float:
    waves = _tenant_workload()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    # 7 tenants (odd, so round robin moves each tenant between engines every wave); each engine
    # holds about half of the prefixes.
    cfg = ClusterConfig(model_path=path, num_engines=2, routing=policy, engine={"max_total_tokens": 1000})
    with Cluster(cfg) as cl:
        for wave in waves:
            cl.generate(input_ids=wave, sampling_params=params)
        stats = cl.stats()
        cl.check_memory()
    cached = sum(e.engine.cached_tokens for e in stats.engines)
    prompt = sum(e.engine.prompt_tokens for e in stats.engines)
    return cached / prompt


def test_cache_aware_beats_round_robin(ray_local, model_dirs):
    aware = _hit_rate("cache_aware", model_dirs["stories"])
    rr = _hit_rate("round_robin", model_dirs["stories"])
    assert aware >= 2 * rr, (aware, rr)
    assert aware > 0.5


def test_engine_killed_under_load(clusters):
    cl = clusters.get("stories")
    params = SamplingParams(max_new_tokens=600, temperature=0.0, ignore_eos=True)  # running at the kill (finals_after checks)
    finals = cl.run(finals_after(cl, [f"Story {i}: once upon a time" for i in range(12)], params,
                                 lambda: ray.kill(cl.actors[0], no_restart=False), timeout_s=180))
    assert len(finals) == 12
    for f in finals:  # every request ended: full output, or an explicit error
        assert f.finish_reason in ("length", "abort")
        assert (f.finish_reason == "length" and f.error is None) or f.error
    assert any(f.error for f in finals) and any(f.error is None for f in finals)
    cl.wait_healthy(timeout_s=120)
    deadline = time.monotonic() + 30
    while not all(cl.healthy()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(cl.healthy())
    again = cl.generate(prompt=["Once upon a time"] * 4, sampling_params=GREEDY)
    assert len({tuple(o.token_ids) for o in again}) == 1 and all(o.error is None for o in again)
    cl.check_memory()


def test_failed_start_leaves_nothing_behind(ray_local, model_dirs, tmp_path):
    """An engine that cannot load its model fails the constructor, which takes down every actor
    and the placement group it had started (and does not hang on Ray restarting them)."""
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text("{}")  # a folder that is no model: refused before any actor
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Cluster(ClusterConfig(model_path=str(tmp_path / "none"), num_engines=2, max_restarts=0))
    broken = shutil.copytree(model_dirs["llama"], tmp_path / "broken")  # tokenizer and config load here...
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")  # ...the weights fail in each engine
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    pgs_before = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(ray.exceptions.ActorDiedError, match="EngineActor.__init__"):
        Cluster(ClusterConfig(model_path=str(broken), num_engines=2, max_restarts=0))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} - before
        pgs = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"} - pgs_before
        if not names and not pgs:
            break
        time.sleep(0.2)
    assert not names and not pgs, (names, pgs)
