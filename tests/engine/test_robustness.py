"""No request can harm an engine: sampler-hostile values, failing forwards, failing outputs,
and a dying loop. After each, the engine still serves and its idle invariant holds."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import Engine, InvalidRequestError, SamplingParams
from engine.errors import EngineDeadError
from engine.sampling import sample_on_device
from engine.scheduler import MAX_CONSECUTIVE_BATCH_FAILURES

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [20, 21]]
MODES = {
    "normal": {},
    "overlap": {"enable_overlap": True},
    "mixed_chunked": {"enable_mixed_chunk": True, "chunked_prefill_size": 4},
    "no_radix": {"disable_radix_cache": True},
}


@pytest.fixture(scope="module")
def engine(model_dirs):
    return Engine(model_path=model_dirs["llama"], max_total_tokens=512)


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **kw)


def assert_serves(eng: Engine) -> None:
    """The engine still answers, token-exact against a fresh greedy run, and is clean when idle."""
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=greedy())
    assert out.error is None and len(out.token_ids) == 8
    eng.check_memory()


# ---- values the sampler cannot handle: refused (400) or normalised --------------------------
@pytest.mark.parametrize("field,value,param", [
    ("top_k", 2**63, "top_k"),
    ("top_k", 10**30, "top_k"),
    ("top_k", 100_000, "top_k"),  # above the vocabulary
    ("repetition_penalty", 1e-300, "repetition_penalty"),
    ("repetition_penalty", 1e300, "repetition_penalty"),
    ("temperature", float("inf"), "temperature"),
    ("temperature", 10**400, "temperature"),
    ("top_p", float("nan"), "top_p"),
    ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("stop_token_ids", [2**70], "stop_token_ids"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("max_new_tokens", 2**64, "max_tokens"),
])
def test_hostile_values_are_refused_before_queueing(engine, field, value, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 4, field: value}
                        if field != "max_new_tokens" else {field: value})
    assert err.value.param == param
    assert not engine.scheduler.has_work()
    assert_serves(engine)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_tiny_temperature_is_greedy(engine, temperature):
    base = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy())
    out = engine.generate(input_ids=PROMPTS[2], sampling_params=SamplingParams(
        max_new_tokens=8, temperature=temperature))
    assert out.token_ids == base.token_ids
    assert_serves(engine)


def test_seed_beyond_64_bits_is_reduced(engine):
    kw = dict(max_new_tokens=8, temperature=1.0)
    a = engine.generate(input_ids=PROMPTS[0], sampling_params=SamplingParams(seed=2**70 + 5, **kw))
    b = engine.generate(input_ids=PROMPTS[0], sampling_params=SamplingParams(seed=(2**70 + 5) % 2**64, **kw))
    assert a.token_ids == b.token_ids and a.error is None
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert_serves(engine)


def test_extreme_but_valid_values_run(engine):
    """The edges of every accepted range sample without failing."""
    extremes = [dict(temperature=1e-5), dict(temperature=1e6), dict(repetition_penalty=0.01),
                dict(repetition_penalty=100.0), dict(top_k=engine.model_config.vocab_size),
                dict(top_p=1e-9), dict(min_p=1.0), dict(frequency_penalty=2.0, presence_penalty=-2.0)]
    outs = engine.generate(input_ids=[PROMPTS[3]] * len(extremes),
                           sampling_params=[SamplingParams(max_new_tokens=6, seed=1, **kw) for kw in extremes])
    for kw, out in zip(extremes, outs):
        assert out.error is None and len(out.token_ids) == 6, kw
    assert_serves(engine)


# ---- the sampler itself never raises ---------------------------------------------------------
class _Row:
    def __init__(self, **kw) -> None:
        self.sampling_params = SamplingParams(max_new_tokens=1, **kw)
        self.generator = torch.Generator().manual_seed(0)
        self.origin_input_ids, self.output_ids = [1, 2], [3]


def test_sampler_flags_non_finite_rows_and_samples_the_rest():
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[3] = float("-inf")  # nothing to sample from
    rows = [_Row(temperature=0), _Row(temperature=1.0), _Row(temperature=0.7, top_k=5), _Row(temperature=1.0)]
    ids, bad, _ = sample_on_device(logits, rows)
    assert bad.tolist() == [False, True, False, True]
    assert ids[0].item() == logits[0].argmax().item()
    assert 0 <= ids[2].item() < 50 and ids[2].item() in logits[2].topk(5).indices.tolist()


@pytest.mark.parametrize("mode", ["normal", "overlap"])
def test_non_finite_logits_fail_that_request_only(model_dirs, mode):
    """Under overlap the next decode batch is already in flight when the bad row is found: the
    other requests' rows must still line up with their requests."""
    engine = Engine(model_path=model_dirs["llama"], max_total_tokens=512, **MODES[mode])
    base = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
    forward = engine.model_runner.forward
    decodes = {"n": 0}

    def poisoned(fb):
        logits = forward(fb)
        if fb.forward_mode.is_decode():
            decodes["n"] += 1
            if decodes["n"] == 3:
                logits[1, 3] = float("nan")  # request 1, on its third decode step
        return logits

    engine.model_runner.forward = poisoned
    outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
    engine.model_runner.forward = forward
    assert outs[1].finish_reason == "abort" and outs[1].error_kind == "engine_error"
    assert "non-finite" in outs[1].error
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].token_ids == base[i].token_ids
    assert_serves(engine)


# ---- a forward that raises fails exactly its batch -------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_failing_forward_fails_its_batch_and_the_engine_goes_on(model_dirs, mode):
    eng = Engine(model_path=model_dirs["llama"], max_total_tokens=512, **MODES[mode])
    base = eng.generate(input_ids=PROMPTS, sampling_params=greedy(12))
    calls = {"n": 0}
    forward_and_sample = eng.model_runner.forward_and_sample

    def flaky(fb, reqs, from_future, partial=frozenset()):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return forward_and_sample(fb, reqs, from_future, partial)

    eng.model_runner.forward_and_sample = flaky
    outs = eng.generate(input_ids=PROMPTS, sampling_params=greedy(12))
    failed = [o for o in outs if o.error is not None]
    assert failed, "the injected failure hit no request"
    for o in failed:
        assert o.error_kind == "engine_error" and "injected forward failure" in o.error
    for o, b in zip(outs, base):
        if o.error is None:
            assert o.token_ids == b.token_ids
    assert eng.scheduler.num_failed == len(failed)
    eng.check_memory()
    # The same prompts again: nothing garbage was cached, so the outputs are exact.
    again = eng.generate(input_ids=PROMPTS, sampling_params=greedy(12))
    assert [o.token_ids for o in again] == [b.token_ids for b in base]
    eng.check_memory()
    eng.shutdown()


def test_batches_failing_in_a_row_kill_the_loop_and_fail_everything(model_dirs):
    eng = Engine(model_path=model_dirs["llama"], max_total_tokens=512)
    died = threading.Event()
    eng.on_fatal = lambda e: died.set()

    def broken(fb, reqs, from_future):
        raise RuntimeError("device lost")

    eng.model_runner.forward_and_sample = broken
    eng.start_loop()
    for _ in range(MAX_CONSECUTIVE_BATCH_FAILURES):  # at least one failing batch each
        try:
            outs = eng.generate(input_ids=PROMPTS, sampling_params=greedy(50))
        except EngineDeadError:  # the loop took this round's first requests in batches of their
            break  # own, and the last failure came while the rest were being submitted
        assert all(o.finish_reason == "abort" and o.error_kind == "engine_error" for o in outs)
        if eng.dead is not None:
            break
    assert died.wait(10)
    assert isinstance(eng.dead, EngineDeadError)
    with pytest.raises(EngineDeadError):
        eng.generate(input_ids=PROMPTS[0], sampling_params=greedy())


def test_failing_output_ends_that_request_only(engine, monkeypatch):
    from engine.tokenizer import IncrementalDetokenizer

    base = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
    victims: set[int] = set()  # ids of the detokenizers that fail
    step, drain = IncrementalDetokenizer.step, engine._drain_inbox

    def flaky_step(self, ids, finished):
        if id(self) in victims and ids:
            raise UnicodeError("injected detokenizer failure")
        return step(self, ids, finished)

    def drain_and_pick_victim():
        drain()
        victims.update(id(tr.detok) for tr in engine._trackers.values() if tr.req.origin_input_ids == PROMPTS[2])

    monkeypatch.setattr(IncrementalDetokenizer, "step", flaky_step)
    monkeypatch.setattr(engine, "_drain_inbox", drain_and_pick_victim)
    aborted = engine.scheduler.num_aborted
    outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
    monkeypatch.undo()
    assert outs[2].error_kind == "engine_error" and "injected detokenizer failure" in outs[2].error
    for i in (0, 1, 3):
        assert outs[i].token_ids == base[i].token_ids
    assert engine.scheduler.num_aborted == aborted + 1  # its generation was stopped too
    assert_serves(engine)
