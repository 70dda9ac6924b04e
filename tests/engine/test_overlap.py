"""Overlap scheduling gives the same tokens as the plain loop, and frees memory exactly once."""

from __future__ import annotations

import random

import pytest

from engine import Engine, SamplingParams
from tests.helpers import GREEDY, assert_matches_hf, prompts, run_staggered

SCENARIOS = {
    "single": dict(n=1, kw={}),
    "sixteen": dict(n=16, kw={}),
    "chunked": dict(n=6, kw={"chunked_prefill_size": 7}),
    "retraction": dict(n=12, kw={"max_total_tokens": 150}),
    "no_radix": dict(n=10, kw={"disable_radix_cache": True, "max_total_tokens": 300}),
    "lpm": dict(n=10, kw={"schedule_policy": "lpm", "max_prefill_tokens": 64}),
}


@pytest.mark.parametrize("name", ["llama", "qwen3", "stories"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_overlap_matches_hf(model_dirs, hf, name, scenario):
    """transformers is the reference (the plain loop matches it in tests/engine/test_parity.py)."""
    sc = SCENARIOS[scenario]
    path = model_dirs[name]
    eng = Engine(model_path=path, enable_overlap=True, **sc["kw"])
    ids = prompts(eng, sc["n"], seed=21, lo=5, hi=40)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    assert_matches_hf(eng, hf, path, ids, outs, n=24)
    assert eng.stats().overlapped_steps > 0
    if scenario == "retraction":
        assert eng.stats().num_retracted > 0
    eng.check_memory()


def test_overlap_mixed_staggered(model_dirs, hf):
    path = model_dirs["llama"]
    eng = Engine(model_path=path, enable_overlap=True, enable_mixed_chunk=True, chunked_prefill_size=8)
    ids = prompts(eng, 8, seed=22, lo=10, hi=40)
    outs = run_staggered(eng, ids, GREEDY)
    assert_matches_hf(eng, hf, path, ids, outs)
    assert eng.stats().overlapped_steps > 0
    eng.check_memory()


def test_overlap_stress_finishing_every_step(model_dirs):
    path = model_dirs["stories"]
    rng = random.Random(5)
    plain, over = Engine(model_path=path), Engine(model_path=path, enable_overlap=True, max_total_tokens=600)
    ids = prompts(plain, 40, seed=23, lo=2, hi=20)
    params = [SamplingParams(max_new_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True,
                             stop=["e"] if i % 5 == 0 else ()) for i in range(40)]
    ref = plain.generate(input_ids=ids, sampling_params=params)
    got = over.generate(input_ids=ids, sampling_params=params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(r.token_ids, r.text, r.finish_reason) for r in ref]
    assert over.stats().overlapped_steps > 0
    over.check_memory()
    assert over.scheduler.cache.available_size() == 600
    over.scheduler.cache.allocator.check_no_duplicates()


def test_overlap_abort_and_sampling(model_dirs):
    path = model_dirs["stories"]
    eng = Engine(model_path=path, enable_overlap=True)
    got: dict[str, list] = {"a": [], "b": []}
    p = SamplingParams(max_new_tokens=300, temperature=0.8, seed=7, ignore_eos=True)
    ids = eng.tokenize(prompt="Once upon a time")
    eng.submit(ids, p, got["a"].append, rid="a")
    eng.submit(ids, SamplingParams(max_new_tokens=30, temperature=0.8, seed=7), got["b"].append, rid="b")
    for _ in range(6):
        eng.step()
    eng.abort("a")
    while eng.step():
        pass
    assert got["a"][-1].finish_reason == "abort"
    assert eng.stats().overlapped_steps > 0
    plain = Engine(model_path=path).generate(input_ids=ids, sampling_params=SamplingParams(
        max_new_tokens=30, temperature=0.8, seed=7))
    assert [t for d in got["b"] for t in d.token_ids] == plain.token_ids  # seeded: same tokens
    eng.check_memory()
