"""An attention-DP group in the fleet: a Serve gang (its own module: the apps of test_fleet.py
hold the test Ray's CPUs until that module ends)."""

from __future__ import annotations

import httpx
import ray

from deploy.app import build_app
from tests.serve.test_fleet import engines_of, wait_for_engines


def test_an_attention_dp_group_is_a_serve_gang(serve_base, model_dirs):
    """dp_attention in the fleet: the group's two engines are one Serve gang, step together
    (IDLE batches for the member with no request) and answer as one engine would."""
    from ray import serve

    from engine import Engine, SamplingParams

    path = model_dirs["stories"]
    ref = Engine(model_path=path).generate(prompt="Once upon a time",
                                           sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0))
    serve.run(build_app({"model_path": path, "num_engines": 2, "dp_attention": True, "dp_group_size": 2}),
              name="fleet-dp", route_prefix="/fleet-dp")
    base = serve_base + "/fleet-dp"
    try:
        wait_for_engines(base, 2)
        for _ in range(3):
            r = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref.text
        stats = ray.get([e.stats.remote() for e in engines_of(base)])
        assert all(s.dp is not None and s.dp.steps > 0 for s in stats)  # both stepped in lock-step
        assert any(s.engine.batches_by_mode["IDLE"] > 0 for s in stats)
    finally:
        serve.delete("fleet-dp")
