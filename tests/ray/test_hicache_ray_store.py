"""The hierarchical cache's `ray` storage backend on a real Ray cluster: two engine actors share one
named store actor, so the second engine, which never saw a prompt, loads its prefix from the pages
the first one wrote, and its output is the same as computing it."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from actors.hicache_store import STORE_NAMESPACE
from actors.protocol import GenerateRequest, decode_delta, encode
from cluster import Cluster, ClusterConfig
from engine import SamplingParams

pytestmark = pytest.mark.ray
PAGE = 64


def run_on(cl: Cluster, engine: int, ids: list[int], n: int) -> list[int]:
    """A request on one engine directly (bypassing the router): its output tokens."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    payload = encode(GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling_params=params))
    out: list[int] = []
    for ref in cl.actors[engine].generate.remote(payload):
        out += decode_delta(ray.get(ref)).token_ids
    return out


def test_an_engine_loads_the_prefix_another_engine_wrote(ray_local, model_dirs):
    store = f"test-{uuid.uuid4().hex[:8]}"
    engine = {"max_total_tokens": 1024, "enable_hierarchical_cache": True, "hicache_ratio": 2.0,
              "hicache_storage_backend": "ray", "hicache_storage_path": store,
              "hicache_storage_page_size": PAGE}
    cfg = ClusterConfig(model_path=model_dirs["llama"], num_engines=2, engine=engine)
    prompt = [(7 * i) % 200 + 3 for i in range(3 * PAGE + 10)]  # three whole pages and a tail
    with Cluster(cfg) as cl:
        want = run_on(cl, 0, prompt, 6)
        actor = ray.get_actor(f"radixray-hicache-{store}", namespace=STORE_NAMESPACE)
        try:
            _check_the_second_engine(cl, actor, prompt, want)
        finally:
            ray.kill(actor)  # detached: it would outlive the test


def _check_the_second_engine(cl: Cluster, actor, prompt: list[int], want: list[int]) -> None:
    deadline = time.monotonic() + 30
    while ray.get(actor.stats.remote())["pages"] < 3:  # write-through runs beside the forward
        assert time.monotonic() < deadline, "the first engine never wrote its pages to the store"
        time.sleep(0.05)
    assert run_on(cl, 1, prompt, 6) == want
    stats = [s.engine for s in cl.stats().engines]
    assert stats[1].hicache.storage.hit_tokens == 3 * PAGE  # the tail is computed
    assert stats[1].cached_tokens == 3 * PAGE and stats[0].cached_tokens == 0
    assert stats[1].hicache.storage_pages_corrupt == 0
    cl.check_memory()
