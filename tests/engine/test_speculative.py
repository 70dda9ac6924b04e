"""Speculative decoding (n-gram drafts and a draft model, TARGET_VERIFY): greedy output identical
to plain decoding in every batching mode, stops inside an accepted block, aborts, the memory
invariant (the draft model's pool too); and the rejection sampler keeps the target distribution
(chi-square), which a broken rule fails."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, SamplingParams
from engine.builtin_model import (
    byte_level_tokenizer,
    llama_config,
    random_llama_weights,
    write_checkpoint,
)
from engine.errors import ConfigError
from engine.req import Req
from engine.speculative import NgramDrafter, verify
from tests.conftest import SMALL

NGRAM = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
DRAFTERS = ("ngram", "draft_self", "draft_other")


def spec(drafter: str, model_dirs, near_draft: str | None = None) -> dict:
    """Engine options of a drafter: n-gram, or a draft model that is the target itself (its
    drafts are the target's own argmax: all accepted) or another model with the same tokenizer
    (the target's weights plus noise: some drafts kept, some not)."""
    if drafter == "ngram":
        return NGRAM
    draft = model_dirs["llama"] if drafter == "draft_self" else near_draft
    return dict(speculative_algorithm="draft_model", speculative_draft_model_path=draft,
                speculative_num_draft_tokens=4)


def check_acceptance(drafter: str, eng: Engine) -> None:
    s = eng.stats()
    assert s.batches_by_mode["TARGET_VERIFY"] > 0
    assert (s.batches_by_mode["DRAFT_EXTEND_V2"] > 0) == drafter.startswith("draft")
    if drafter == "draft_self":  # same weights, same argmax: every draft is kept
        assert 0 < s.spec_accepted_tokens == s.spec_draft_tokens
    else:
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short pattern (so drafts exist) next to plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pattern = [rng.randrange(3, 250) for _ in range(rng.randint(2, 6))]
        head = [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))]
        out.append(head + pattern * rng.randint(2, 8) if i % 4 else head * 3)
    return out


def run(path: str, ids: list[list[int]], params, **engine) -> tuple[list, Engine]:
    eng = Engine(model_path=path, **engine)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    eng.check_memory()
    return outs, eng


MODES = [
    {}, {"disable_radix_cache": True}, {"chunked_prefill_size": 16},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 16, "max_prefill_tokens": 32},
    {"max_total_tokens": 360, "max_running_requests": 8},  # retraction under a tight pool
    {"enable_overlap": True}, {"schedule_policy": "lpm", "speculative_num_draft_tokens": 7},
]


@pytest.mark.parametrize("drafter", DRAFTERS[:2])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_is_unchanged(model_dirs, mode, drafter):
    path, ids = model_dirs["llama"], prompts()
    ref, _ = run(path, ids, GREEDY, **{k: v for k, v in mode.items() if not k.startswith("speculative")})
    got, eng = run(path, ids, GREEDY, **{**spec(drafter, model_dirs), **mode})
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    check_acceptance(drafter, eng)


@pytest.mark.parametrize("mode", [MODES[0], MODES[3], MODES[4]])
def test_greedy_output_is_unchanged_with_another_draft_model(model_dirs, near_draft, mode):
    """Drafts the target mostly rejects: the draft KV of rejected drafts is dropped and caught
    up again, in plain, MIXED and retracting runs."""
    path, ids = model_dirs["llama"], prompts()
    ref, _ = run(path, ids, GREEDY, **mode)
    got, eng = run(path, ids, GREEDY, **{**spec("draft_other", model_dirs, near_draft), **mode})
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    check_acceptance("draft_other", eng)


@pytest.mark.parametrize("drafter", DRAFTERS[:2])
@pytest.mark.parametrize("mode", [MODES[0], MODES[4], MODES[5]])
def test_verify_batches_padded_to_a_graph_width(model_dirs, mode, drafter):
    """A CUDA verify graph's shape, run eagerly here: every request padded with filler tokens
    to 1 + k positions (their logits dropped, their slots freed with the rejected drafts').
    Output and memory unchanged, in a plain, a retracting and an overlapped run."""
    path, ids = model_dirs["llama"], prompts()
    ref, _ = run(path, ids, GREEDY, **mode)
    eng = Engine(model_path=path, **{**spec(drafter, model_dirs), **mode})
    runner, shapes = eng.model_runner, []
    runner.verify_graph_width = lambda bs: 5
    forward_and_verify = runner.forward_and_verify

    def record(fb, reqs, drafts):
        shapes.append((list(fb.extend_seq_lens_cpu), [len(d) for d in drafts]))
        return forward_and_verify(fb, reqs, drafts)

    runner.forward_and_verify = record
    got = eng.generate(input_ids=ids, sampling_params=GREEDY)
    eng.check_memory()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    check_acceptance(drafter, eng)
    assert any(widths == [5] * len(widths) and min(lens) < 4 for widths, lens in shapes)  # filler ran


def test_padded_verify_batches_with_the_triton_kernels(model_dirs):
    """The padded verify shape through the Triton extend kernel (the one a CUDA verify graph
    replays), in Triton's interpreter: output unchanged."""
    pytest.importorskip("triton")
    path, ids = model_dirs["llama"], prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    ref, _ = run(path, ids, params)
    eng = Engine(model_path=path, attention_backend="triton", **NGRAM)
    eng.model_runner.verify_graph_width = lambda bs: 5
    got = eng.generate(input_ids=ids, sampling_params=params)
    eng.check_memory()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert eng.stats().spec_accepted_tokens > 0


def test_draft_model_config_errors(model_dirs, tmp_path):
    with pytest.raises(ConfigError, match="speculative_draft_model_path"):
        Engine(model_path=model_dirs["llama"], speculative_algorithm="draft_model")
    with pytest.raises(ConfigError, match="speculative_draft_model_path"):
        Engine(model_path=model_dirs["llama"], speculative_draft_model_path=model_dirs["qwen2"])
    cfg = llama_config(**{**SMALL, "vocab_size": 300})
    other = write_checkpoint(str(tmp_path / "v300"), cfg, random_llama_weights(cfg, seed=3), byte_level_tokenizer())
    with pytest.raises(ConfigError, match="vocabulary"):
        Engine(model_path=model_dirs["llama"], speculative_algorithm="draft_model", speculative_draft_model_path=other)


def test_a_draft_model_with_a_shorter_context(model_dirs, tmp_path):
    """The target's own weights with a 48-token context as the draft: requests draft (and keep
    every draft) until they outgrow it, then decode plainly; output and memory unchanged."""
    from safetensors.torch import load_file

    cfg = llama_config(**{**SMALL, "max_position_embeddings": 48})
    weights = load_file(f"{model_dirs['llama']}/model.safetensors")
    short = write_checkpoint(str(tmp_path / "short"), cfg, weights, byte_level_tokenizer())
    path, ids = model_dirs["llama"], prompts(8, seed=13)
    ref, _ = run(path, ids, GREEDY)
    got, eng = run(path, ids, GREEDY, speculative_algorithm="draft_model", speculative_draft_model_path=short)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    s = eng.stats()
    assert 0 < s.spec_accepted_tokens == s.spec_draft_tokens
    assert any(len(i) + len(o.token_ids) > 48 for i, o in zip(ids, got))


def test_a_failing_draft_forward_only_skips_drafting(model_dirs, near_draft):
    """Drafting is an optimisation: a draft forward that raises costs that step its drafts (and
    their draft KV goes back to the pool), never a request."""
    path, ids = model_dirs["llama"], prompts(4, seed=11)
    ref, _ = run(path, ids, GREEDY)
    eng = Engine(model_path=path, **spec("draft_other", model_dirs, near_draft))
    drafter, calls = eng.scheduler.drafter, []
    forward = drafter.runner.forward

    def flaky(fb):
        calls.append(fb.forward_mode)
        if len(calls) in (2, 5):  # a catch-up extend, then a draft decode step, fail
            raise RuntimeError("draft device error")
        return forward(fb)

    drafter.runner.forward = flaky
    got = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert drafter.failures == 2 and eng.stats().spec_draft_tokens > 0
    eng.check_memory()


def test_sampling_with_a_draft_model(model_dirs, near_draft):
    """Sampled requests with draft-model drafts: seeded output is reproducible, lengths are
    exact and every slot (target and draft) returns to its pool."""
    path, ids = model_dirs["llama"], prompts(4, seed=12)
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    outs = [run(path, ids, params, **spec("draft_other", model_dirs, near_draft))[0] for _ in range(2)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(len(o.token_ids) == 30 for o in outs[0])


def test_greedy_on_real_text(model_dirs):
    path = model_dirs["stories"]
    texts = ["Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily",
             "The cat sat on the mat. The cat sat on the", "Tom had a red ball. Tom had a"]
    eng_ref, eng = Engine(model_path=path), Engine(model_path=path, **NGRAM)
    params = SamplingParams(max_new_tokens=64, temperature=0)
    assert ([o.token_ids for o in eng.generate(prompt=texts, sampling_params=params)]
            == [o.token_ids for o in eng_ref.generate(prompt=texts, sampling_params=params)])
    assert eng.stats().spec_accepted_tokens > 0
    eng.check_memory()


@pytest.mark.parametrize("drafter", DRAFTERS[:2])
def test_stops_inside_an_accepted_block(model_dirs, drafter):
    """max_new_tokens and stop strings or stop token ids that fall mid-block end the request
    exactly where plain decoding ends it; logprobs come for every emitted token."""
    path, ids = model_dirs["llama"], prompts(4, seed=3)
    base, _ = run(path, ids, GREEDY)
    rng = random.Random(1)
    params = []
    for out in base:
        cut = rng.randrange(3, 30)
        params.append(SamplingParams(max_new_tokens=cut, temperature=0, ignore_eos=True, logprobs=True))
        params.append(SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                                     stop_token_ids=[out.token_ids[cut]]))
        text = out.text
        params.append(SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                                     stop=[text[len(text) // 2:len(text) // 2 + 3]] if len(text) > 8 else []))
    many = [i for i in ids for _ in range(3)]
    ref, _ = run(path, many, params)
    got, eng = run(path, many, params, **spec(drafter, model_dirs))
    assert [(o.token_ids, o.finish_reason, o.text) for o in got] == [(o.token_ids, o.finish_reason, o.text)
                                                                     for o in ref]
    for o in got[::3]:
        assert len(o.logprobs) == len(o.token_ids)
        assert [lp.token_id for lp in o.logprobs] == o.token_ids
    for a, b in zip(got[::3], ref[::3]):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    assert eng.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_verifying(model_dirs, near_draft, drafter, overlap):
    eng = Engine(model_path=model_dirs["llama"], enable_overlap=overlap, **spec(drafter, model_dirs, near_draft))
    params = SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True)
    ids = prompts(2, seed=5)
    streams = [eng.stream(input_ids=i, sampling_params=params) for i in ids]
    for s in streams:
        next(s)
    while eng.stats().batches_by_mode["TARGET_VERIFY"] < 3:
        eng.step()
    if overlap:  # the step returned with its verify batch still running on the forward thread
        assert eng.scheduler.inflight[0].forward_mode.is_target_verify()
    for s in streams:
        s.close()  # aborts; the engine applies it before the next batch
    while eng.step():
        pass
    assert eng.stats().num_aborted == 2
    eng.check_memory()


def test_ngram_drafter():
    d = NgramDrafter(k=3, min_n=2, max_n=3)
    req = Req("r", [1, 2, 3, 4, 5, 1, 2, 3], SamplingParams(max_new_tokens=10))
    assert d.propose(req, limit=10) == [4, 5, 1]  # [1, 2, 3] was followed by 4, 5, 1
    assert d.propose(req, limit=2) == [4, 5]
    req.output_ids += [4, 9]  # ... 3, 4, 9: [3, 4] is followed by 5 earlier
    assert d.propose(req, limit=10) == []  # [4, 9] and [3, 4, 9] never occurred
    req.output_ids += [1, 2]
    assert d.propose(req, limit=10) == [3, 4, 9]  # [9, 1, 2] is new; [1, 2] last continued with 3, 4, 9
    loop = Req("l", [5, 8, 6, 8, 6, 8], SamplingParams(max_new_tokens=10))
    assert d.propose(loop, limit=10) == [6, 8, 6]  # runs into the present: the period (2) repeats
    d.feedback(loop, 3, 0)  # nothing kept: depth 3 -> 1
    assert d.propose(loop, limit=10) == [6]
    d.feedback(loop, 1, 0)  # depth 0: plain decoding for a while
    assert [d.propose(loop, limit=10) for _ in range(NgramDrafter.COOLDOWN)] == [[]] * NgramDrafter.COOLDOWN
    assert d.propose(loop, limit=10) == [6]
    d.feedback(loop, 1, 1)
    assert d.propose(loop, limit=10) == [6, 8]  # all kept: depth doubles


# ---- the sampler keeps the target's distribution -----------------------------------------------
class _Fake:
    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.sampling_params, self.origin_input_ids, self.output_ids = params, [1], []
        self.generator = torch.Generator().manual_seed(seed)


def _first_two(logits: torch.Tensor, draft: list[int], params: SamplingParams, n: int,
               verify_fn=verify) -> tuple[list[int], list[int]]:
    firsts, seconds = [], []
    for seed in range(n):
        out = verify_fn(logits, [_Fake(params, seed)], [draft]).tokens[0]
        firsts.append(out[0])
        if out[0] == draft[0]:
            seconds.append(out[1])
    return firsts, seconds


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from engine.sampling import filtered_probs

    return filtered_probs(logits.float(), [params] * logits.shape[0])


def _fits(samples: list[int], probs: torch.Tensor) -> float:
    # Imported here: the GPU check imports this module's prompts() on a machine without scipy.
    from scipy.stats import chisquare

    support = [t for t in range(probs.numel()) if probs[t] > 0]
    assert set(samples) <= set(support), "a token the target never samples"
    if len(support) == 1:
        return 1.0
    observed = [samples.count(t) for t in support]
    mass = sum(float(probs[t]) for t in support)
    expected = [float(probs[t]) / mass * len(samples) for t in support]
    expected[-1] = len(samples) - sum(expected[:-1])  # sums agree exactly (chisquare checks)
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    draft = [int(torch.argsort(logits[0])[-2]), 1]  # a likely but not the likeliest first draft
    probs = _target(logits, params)
    firsts, seconds = _first_two(logits, draft, params, 4000)
    # alpha 1e-4 per check: a false failure is rare; the broken rule below is off by far more.
    assert _fits(firsts, probs[0]) > 1e-4
    assert _fits(seconds, probs[1]) > 1e-4


def test_a_broken_acceptance_rule_is_caught():
    """Accepting every draft (what a verify that forgot the rejection step would do) fails."""
    import engine.speculative as spec

    params = SamplingParams(temperature=0.9)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)) * 1.5
    draft = [int(torch.argsort(logits[0])[-2]), 1]

    def broken(logits, reqs, drafts):
        original = spec._rejection_sample
        spec._rejection_sample = lambda probs, d, g: list(d) + [int(torch.multinomial(probs[len(d)], 1,
                                                                                         generator=g)[0])]
        try:
            return verify(logits, reqs, drafts)
        finally:
            spec._rejection_sample = original

    firsts, _ = _first_two(logits, draft, params, 2000, verify_fn=broken)
    with pytest.raises(AssertionError):
        assert _fits(firsts, _target(logits, params)[0]) > 1e-4
