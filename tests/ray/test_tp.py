"""A cluster of tensor-parallel engines (tp_size=2): each engine is rank 0 (the EngineActor) and
a TPWorkerActor in one placement group; it serves the same greedy tokens as one in-process
engine, and a killed rank 1 takes its engine down (its requests end with explicit errors) until
Ray restarts the gang and the engine serves again."""

from __future__ import annotations

import time

import pytest
import ray

from cluster import ClusterConfig
from engine import SamplingParams
from tests.helpers import finals_after

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster_configs(model_dirs) -> dict[str, ClusterConfig]:
    # One engine of two ranks, each half of the engine's CPU (this machine's two cores fit it).
    return {
        "tp": ClusterConfig(
            model_path=model_dirs["llama"],
            tp_size=2,
            health_check_period_s=0.5,
            request_timeout_s=120,
            cpus_per_engine=1.0,
        )
    }


def test_tp_engine_serves_like_one_rank(clusters, single, model_dirs):
    cl = clusters.get("tp")
    ref = single(model_dirs["llama"])
    ids = [[1, 5, 6, 7, 8], [1] + list(range(20, 60)), [1, 5, 6, 7, 9, 10]]
    got = [cl.generate(input_ids=p, sampling_params=GREEDY) for p in ids]
    want = ref.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    actor = cl.actors[0]
    workers = ray.get(actor.debug_tp_workers.remote())
    assert len(workers) == 1
    info = ray.get(actor.info.remote())
    assert info.num_parameters < 0.6 * ref.model_runner.model.num_parameters()


def test_killed_rank_restarts_the_gang(clusters, single, model_dirs):
    cl = clusters.get("tp")
    actor = cl.actors[0]
    worker = ray.get(actor.debug_tp_workers.remote())[0]
    incarnation = ray.get(actor.incarnation_id.remote())
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    finals = cl.run(
        finals_after(
            cl,
            [f"Story {i}: once upon a time" for i in range(3)],
            params,
            lambda: ray.kill(worker, no_restart=True),
            timeout_s=120,
        )
    )
    for f in finals:  # each ended: the whole output, or an explicit error
        assert f.finish_reason in ("length", "abort")
        assert (f.finish_reason == "length" and f.error is None) or f.error
    assert any(f.error for f in finals)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.incarnation_id.remote(), timeout=5) != incarnation and all(
                cl.healthy()
            ):
                break
        except Exception:  # restarting
            pass
        time.sleep(0.2)
    assert ray.get(actor.incarnation_id.remote()) != incarnation
    cl.wait_healthy(timeout_s=60)
    ref = single(model_dirs["llama"])
    ids = [1, 5, 6, 7, 8]
    again = cl.generate(input_ids=ids, sampling_params=GREEDY)
    assert again.error is None
    assert again.token_ids == ref.generate(input_ids=ids, sampling_params=GREEDY).token_ids
    assert len(ray.get(actor.debug_tp_workers.remote())) == 1
