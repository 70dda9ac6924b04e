"""Prompt logprobs (vLLM's prompt_logprobs): the logprob, rank and top-k of every prompt token
match transformers, in every batching mode, chunked or not, and whatever the prefix cache holds;
the tokens generated are the same as without them."""

from __future__ import annotations

import pytest

from engine import Engine, InvalidRequestError, SamplingParams
from engine.engine import collect_output
from tests.helpers import GREEDY, prompts, run_staggered

WITH_PROMPT = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=3)


def check_against_hf(hf, path: str, ids: list[int], prompt_logprobs: list, k: int = 3) -> None:
    ref = hf.logprobs(path, ids)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        e, row = prompt_logprobs[pos], ref[pos - 1]
        assert abs(e.logprob - float(row[ids[pos]])) < 1e-4
        assert e.rank == int((row > row[ids[pos]]).sum()) + 1
        top = row.topk(k)
        assert [t for t, _ in e.top_logprobs] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(e.top_logprobs, top.values.tolist())) < 1e-4


def test_prompt_logprobs_match_transformers(model_dirs, hf):
    path = model_dirs["qwen2"]
    eng = Engine(model_path=path)
    ids = prompts(eng, 1, seed=11, lo=20, hi=30)[0]
    out = eng.generate(input_ids=ids, sampling_params=WITH_PROMPT)
    check_against_hf(hf, path, ids, out.prompt_logprobs)
    assert out.token_ids == hf.greedy(path, ids, 16)
    # The same prompt again: the cache holds it, but prompt logprobs need every position computed.
    again = eng.generate(input_ids=ids, sampling_params=WITH_PROMPT)
    assert again.cached_tokens == 0 and again.prompt_logprobs == out.prompt_logprobs
    plain = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert plain.prompt_logprobs is None and plain.cached_tokens == len(ids) - 1 and plain.token_ids == out.token_ids
    one = eng.generate(input_ids=ids[:1], sampling_params=WITH_PROMPT)
    assert one.prompt_logprobs == [None]
    eng.check_memory()


@pytest.mark.parametrize("options", [
    dict(chunked_prefill_size=8),
    dict(chunked_prefill_size=8, enable_mixed_chunk=True),
    dict(enable_overlap=True, chunked_prefill_size=16),
    dict(disable_radix_cache=True, chunked_prefill_size=8),
], ids=["chunked", "mixed", "overlap", "no-cache"])
def test_every_batching_mode(model_dirs, hf, options):
    """Prefills land while others decode (and, chunked, run over several steps); requests with
    and without prompt logprobs share batches and prefixes."""
    path = model_dirs["llama"]
    eng = Engine(model_path=path, **options)
    ids = prompts(eng, 6, seed=3, lo=10, hi=40)
    ids[3] = ids[0][:20] + ids[3]  # shares a head with the first: it may hit the cache, it must not
    results: dict[str, list] = {}
    for i, p in enumerate(ids):  # every other one with prompt logprobs, one submitted every 2 steps
        results[f"r{i}"] = []
        eng.submit(p, WITH_PROMPT if i % 2 == 0 else GREEDY, lambda d: results[d.rid].append(d), rid=f"r{i}")
        eng.step()
        eng.step()
    while eng.step():
        pass
    mixed = [collect_output(f"r{i}", results[f"r{i}"]) for i in range(len(ids))]
    staggered = run_staggered(eng, ids, WITH_PROMPT, every=1)
    for i, (p, m, s) in enumerate(zip(ids, mixed, staggered)):
        assert s.token_ids == hf.greedy(path, p, 16) == m.token_ids
        check_against_hf(hf, path, p, s.prompt_logprobs)
        if i % 2 == 0:
            check_against_hf(hf, path, p, m.prompt_logprobs)
        else:
            assert m.prompt_logprobs is None
    eng.check_memory()


def test_one_token_chunks(model_dirs, hf):
    """Chunks of one token: the forward has one row per request, prompt logprobs still come."""
    path = model_dirs["llama"]
    eng = Engine(model_path=path, chunked_prefill_size=1)
    ids = prompts(eng, 1, seed=4, lo=8, hi=12)[0]
    out = eng.generate(input_ids=ids, sampling_params=WITH_PROMPT)
    check_against_hf(hf, path, ids, out.prompt_logprobs)
    assert out.token_ids == hf.greedy(path, ids, 16)
    eng.check_memory()


def test_bad_prompt_logprobs():
    for bad in (-1, 21, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"
