"""Structured outputs under attention-DP: the lock-step members mask their own requests; the
group's constrained outputs are the single engine's."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from cluster import Cluster, ClusterConfig
from engine import Engine, SamplingParams

pytestmark = pytest.mark.ray

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["k", "n"], "additionalProperties": False}


def test_dp_group_constrained_matches_single_engine(ray_local, model_dirs):
    path = model_dirs["llama"]
    rng = random.Random(3)
    ids = [[1] + [rng.randrange(5, 261) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=200, temperature=0.0, json_schema=json.dumps(SCHEMA)),
              SamplingParams(max_new_tokens=30, temperature=0.0, regex="[a-z]{3}-[0-9]{2}")] * 2
    ref = Engine(model_path=path).generate(input_ids=ids, sampling_params=params)
    config = ClusterConfig(model_path=path, num_engines=2, routing="round_robin", dp_attention=True)
    with Cluster(config) as cl:
        outs = cl.generate(input_ids=ids, sampling_params=params)
        cl.check_memory()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o in outs[::2]:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
