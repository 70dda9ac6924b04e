"""Speculative decoding inside an attention-DP group: members verify different numbers of draft
tokens in one lock-step (a member with nothing runs IDLE), and greedy output is unchanged."""

from __future__ import annotations

import pytest

from cluster import Cluster, ClusterConfig
from engine import SamplingParams
from tests.engine.test_speculative import prompts

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_group_with_drafts_matches_plain_decoding(ray_local, model_dirs, near_draft, single, drafter):
    """Each member drafts on its own (an n-gram index, or its own copy of the draft model and
    its draft KV); the verify forwards run in lock-step."""
    path = model_dirs["llama"]
    ids = prompts(6, seed=9)
    ref = single(path).generate(input_ids=ids, sampling_params=GREEDY)
    spec = ({"speculative_algorithm": "ngram"} if drafter == "ngram" else
            {"speculative_algorithm": "draft_model", "speculative_draft_model_path": near_draft})
    cfg = ClusterConfig(model_path=path, num_engines=2, routing="round_robin", enable_dp_attention=True,
                        engine={**spec, "speculative_num_draft_tokens": 3})
    with Cluster(cfg) as cl:
        both = cl.generate(input_ids=ids, sampling_params=GREEDY)
        assert [o.token_ids for o in both] == [r.token_ids for r in ref]
        one = cl.generate(input_ids=ids[1], sampling_params=GREEDY)  # the other member runs IDLE
        assert one.token_ids == ref[1].token_ids
        engines = [e.engine for e in cl.stats().engines]
        assert all(e.batches_by_mode["TARGET_VERIFY"] > 0 for e in engines)
        assert sum(e.batches_by_mode["IDLE"] for e in engines) > 0
        assert 0 < sum(e.spec_accepted_tokens for e in engines) < sum(e.spec_draft_tokens for e in engines)
        cl.check_memory()
