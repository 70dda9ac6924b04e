"""GPU-only checks (marker `gpu`; skipped without CUDA). Their CPU twins are the parity tests."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from engine.forward_batch import ForwardMode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["stories", "llama"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_cuda_matches_fp32_first_tokens(model_dirs, name, backend):
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "Once upon a time"
    ref = Engine(model_path=model_dirs[name], device="cpu").generate(prompt=prompt, sampling_params=params)
    fp32 = Engine(model_path=model_dirs[name], device="cuda", dtype="float32", attention_backend=backend)
    assert fp32.generate(prompt=prompt, sampling_params=params).token_ids == ref.token_ids
    bf16 = Engine(model_path=model_dirs[name], device="cuda", dtype="bfloat16", attention_backend=backend)
    out = bf16.generate(prompt=prompt, sampling_params=params)
    assert out.token_ids == ref.token_ids
    bf16.check_memory()


def test_overlap_on_cuda(model_dirs):
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", "The cat", "Lily had", "Tom"]
    ref = Engine(model_path=model_dirs["stories"], device="cuda").generate(prompt=prompts, sampling_params=params)
    eng = Engine(model_path=model_dirs["stories"], device="cuda", enable_overlap=True, attention_backend="triton")
    assert [o.token_ids for o in eng.generate(prompt=prompts, sampling_params=params)] == [r.token_ids for r in ref]
    eng.check_memory()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_speculative_verify_on_cuda(model_dirs, backend):
    """TARGET_VERIFY batches on the device (extend attention over drafts, all-position logits)
    give the plain decoder's greedy tokens, next to CUDA-graph decode steps."""
    from tests.engine.test_speculative import prompts

    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    ids = prompts(6, seed=2)
    kw = dict(model_path=model_dirs["llama"], device="cuda", dtype="float32", attention_backend=backend)
    ref = Engine(**kw).generate(input_ids=ids, sampling_params=params)
    eng = Engine(**kw, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    assert [o.token_ids for o in eng.generate(input_ids=ids, sampling_params=params)] == [r.token_ids for r in ref]
    assert eng.stats().spec_accepted_tokens > 0
    if backend == "triton":  # graph-safe: verify batches padded to 1 + k replay CUDA graphs
        assert eng.model_runner.graph_runner.replays[ForwardMode.TARGET_VERIFY] > 0
    eng.check_memory()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_draft_model_on_cuda(model_dirs, near_draft, backend):
    """Draft-model speculation on the device: the draft's own pool and CUDA graphs beside the
    target's (the target's pool left room for them), DRAFT_EXTEND_V2 catch-up, greedy parity."""
    from tests.engine.test_speculative import prompts

    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    ids = prompts(6, seed=3)
    kw = dict(model_path=model_dirs["llama"], device="cuda", dtype="float32", attention_backend=backend)
    ref = Engine(**kw).generate(input_ids=ids, sampling_params=params)
    eng = Engine(**kw, speculative_algorithm="draft_model", speculative_draft_model_path=near_draft,
                 speculative_num_draft_tokens=4)
    assert [o.token_ids for o in eng.generate(input_ids=ids, sampling_params=params)] == [r.token_ids for r in ref]
    s = eng.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens and s.batches_by_mode["DRAFT_EXTEND_V2"] > 0
    eng.check_memory()
