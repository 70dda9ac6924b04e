"""Greedy output is token-identical to transformers in every batching mode."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from tests.helpers import GREEDY, assert_matches_hf, prompts, run_staggered

MODELS = ["llama", "qwen2", "qwen3", "stories"]


@pytest.mark.parametrize("name", MODELS)
def test_single_request(model_dirs, hf, name):
    eng = Engine(model_path=model_dirs[name])
    ids = prompts(eng, 1, seed=1)
    out = eng.generate(input_ids=ids[0], sampling_params=GREEDY)
    assert_matches_hf(eng, hf, model_dirs[name], ids, [out])
    eng.check_memory()


@pytest.mark.parametrize("linear_backend", ["onednn", "torch"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_linear_backends(model_dirs, hf, name, linear_backend):
    """oneDNN (prepacked weights, the CPU default where it works) and F.linear both match."""
    from kernels.cpu_linear import onednn_linear_works

    if linear_backend == "onednn" and not onednn_linear_works(torch.float32):
        pytest.skip("this torch build has no working oneDNN linear")
    eng = Engine(model_path=model_dirs[name], linear_backend=linear_backend)
    assert (eng.model_runner.model.lm_head.packed is not None) == (linear_backend == "onednn")
    ids = prompts(eng, 8, seed=5, lo=1, hi=50)
    assert_matches_hf(eng, hf, model_dirs[name], ids, eng.generate(input_ids=ids, sampling_params=GREEDY))
    eng.check_memory()


def test_long_prefill_batch(model_dirs, hf):
    """One extend batch of more than CPU_ROW_BLOCK tokens: norm/qkv/RoPE and the MLP run in row blocks."""
    from engine.models.layers import CPU_ROW_BLOCK

    eng = Engine(model_path=model_dirs["llama"])
    ids = prompts(eng, 4, seed=6, lo=CPU_ROW_BLOCK // 2, hi=CPU_ROW_BLOCK // 2 + 40)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert eng.stats().batches_by_mode["EXTEND"] == 1 and sum(map(len, ids)) > CPU_ROW_BLOCK
    assert_matches_hf(eng, hf, model_dirs["llama"], ids, outs)
    eng.check_memory()


def test_stories_text_matches_transformers(model_dirs, hf):
    from transformers import AutoTokenizer

    path = model_dirs["stories"]
    eng = Engine(model_path=path)
    out = eng.generate(prompt="Once upon a time", sampling_params=SamplingParams(max_new_tokens=32, temperature=0))
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Once upon a time").input_ids
    assert eng.tokenize(prompt="Once upon a time") == ids
    ref = hf.greedy(path, ids, 32)
    assert out.token_ids == ref
    assert out.text == tok.decode(ref, skip_special_tokens=True)
    assert "Once upon a time" + out.text == (
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw")
    eng.check_memory()


@pytest.mark.parametrize("name", MODELS)
def test_sixteen_mixed_lengths_at_once(model_dirs, hf, name):
    eng = Engine(model_path=model_dirs[name])
    ids = prompts(eng, 16, seed=2, lo=1, hi=60)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert_matches_hf(eng, hf, model_dirs[name], ids, outs)
    eng.check_memory()


@pytest.mark.parametrize("name", ["llama", "qwen3", "stories"])
def test_chunked_prefill(model_dirs, hf, name):
    eng = Engine(model_path=model_dirs[name], chunked_prefill_size=7)
    ids = prompts(eng, 6, seed=3, lo=10, hi=50)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert_matches_hf(eng, hf, model_dirs[name], ids, outs)
    eng.check_memory()


@pytest.mark.parametrize("name", ["llama", "qwen2", "stories"])
def test_mixed_batches(model_dirs, hf, name):
    eng = Engine(model_path=model_dirs[name], enable_mixed_chunk=True, chunked_prefill_size=8)
    ids = prompts(eng, 8, seed=4, lo=10, hi=40)
    outs = run_staggered(eng, ids, GREEDY)
    assert eng.stats().batches_by_mode["MIXED"] > 0
    assert_matches_hf(eng, hf, model_dirs[name], ids, outs)
    eng.check_memory()


@pytest.mark.parametrize("name", ["llama", "stories"])
def test_shared_prefix_hits_cache(model_dirs, hf, name):
    eng = Engine(model_path=model_dirs[name])
    prefix = prompts(eng, 1, seed=5, lo=200, hi=200)[0]
    tails = prompts(eng, 4, seed=6, lo=2, hi=8)
    ids = [prefix + t[1:] for t in tails]
    first = eng.generate(input_ids=ids[:2], sampling_params=GREEDY)
    second = eng.generate(input_ids=ids[2:] + ids[:2], sampling_params=GREEDY)
    assert all(o.cached_tokens >= len(prefix) for o in second)
    assert [o.token_ids for o in second[2:]] == [o.token_ids for o in first]
    assert_matches_hf(eng, hf, model_dirs[name], ids[2:] + ids[:2], second)
    eng.check_memory()


@pytest.mark.parametrize("name", ["llama", "qwen3", "stories"])
def test_retraction_keeps_outputs(model_dirs, hf, name):
    # 12 requests of up to ~60 tokens each would need ~700 slots; the pool has 200.
    eng = Engine(model_path=model_dirs[name], max_total_tokens=200)
    ids = prompts(eng, 12, seed=7, lo=20, hi=40)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    assert eng.stats().num_retracted > 0
    assert_matches_hf(eng, hf, model_dirs[name], ids, outs, n=24)
    eng.check_memory()


@pytest.mark.parametrize("name", ["llama", "stories"])
def test_disable_radix_cache(model_dirs, hf, name):
    eng = Engine(model_path=model_dirs[name], disable_radix_cache=True, chunked_prefill_size=16,
                 max_total_tokens=300)
    ids = prompts(eng, 10, seed=8, lo=5, hi=50)
    outs = eng.generate(input_ids=ids + ids[:2], sampling_params=GREEDY)
    assert all(o.cached_tokens == 0 for o in outs)
    assert_matches_hf(eng, hf, model_dirs[name], ids + ids[:2], outs)
    eng.check_memory()
    assert eng.scheduler.cache.allocator.available_size() == 300


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_policies_same_tokens(model_dirs, hf, policy):
    eng = Engine(model_path=model_dirs["llama"], schedule_policy=policy, max_prefill_tokens=64)
    ids = prompts(eng, 10, seed=9, lo=5, hi=50)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert_matches_hf(eng, hf, model_dirs["llama"], ids, outs)
    eng.check_memory()


def test_logprobs_match_transformers(model_dirs, hf):
    path = model_dirs["qwen2"]
    eng = Engine(model_path=path)
    ids = prompts(eng, 1, seed=10)[0]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    out = eng.generate(input_ids=ids, sampling_params=params)
    ref = hf.logprobs(path, ids + out.token_ids)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        top = row.topk(3)
        assert [t for t, _ in lp.top_logprobs] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(lp.top_logprobs, top.values.tolist())) < 1e-4


def test_bfloat16_greedy_agreement_with_float32(model_dirs):
    """bfloat16 weights and KV on the CPU (dtype="bfloat16") are an approximation, so the stated
    tolerance: over 16 prompts x 32 greedy tokens of the random llama, the tokens before each
    request's first divergence from the float32 engine average at least 60% of the output
    (measured: 68%; transformers' own bfloat16 against its float32 reaches 75% on these prompts,
    and our bfloat16 matches its bfloat16 on 84%). Rounding, not a bug, is what diverges: a
    prompt whose first token already differs is allowed."""
    path = model_dirs["llama"]
    f32 = Engine(model_path=path)
    bf16 = Engine(model_path=path, dtype="bfloat16")
    assert bf16.model_runner.dtype == torch.bfloat16 and bf16.model_runner.kv_cache.k[0].dtype == torch.bfloat16
    ids = prompts(f32, 16, seed=0, lo=5, hi=40)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    leading = []
    for a, b in zip(f32.generate(input_ids=ids, sampling_params=params),
                    bf16.generate(input_ids=ids, sampling_params=params)):
        k = 0
        while k < 32 and a.token_ids[k] == b.token_ids[k]:
            k += 1
        leading.append(k)
    assert sum(leading) / (32 * len(leading)) >= 0.6, leading
    bf16.check_memory()
