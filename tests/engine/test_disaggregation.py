"""Prefill/decode disaggregation inside one process: a prefill Engine computes prompts and sends
their KV over the in-process channel; a decode Engine pre-allocates, receives, runs PREBUILT
batches and decodes. Its output equals one Engine's, token for token, in every mode; both
engines end idle and clean, faults included."""

from __future__ import annotations

import json
import time

import pytest

from engine import Engine, SamplingParams
from engine.disaggregation import KVFetch, KVPoll, LocalKVChannel
from engine.disaggregation.local import LocalPrefillSource
from engine.engine import collect_output
from engine.errors import ConfigError, InvalidRequestError
from tests.helpers import prompts

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


class Pair:
    """A prefill engine on its own loop thread and a decode engine that fetches KV from it."""

    def __init__(self, path: str, prefill: dict | None = None, decode: dict | None = None,
                 source_wrapper=None) -> None:
        self.prefill = Engine(model_path=path, disaggregation_mode="prefill", **(prefill or {}))
        self.prefill.start_loop()
        source = LocalPrefillSource([self.prefill])
        self.source = source_wrapper(source) if source_wrapper else source
        self.decode = Engine(model_path=path, disaggregation_mode="decode", kv_source=self.source, **(decode or {}))

    def generate(self, ids, params):
        return self.decode.generate(input_ids=ids, sampling_params=params)

    def close(self) -> None:
        self.prefill.shutdown()


@pytest.fixture
def pair_of(model_dirs):
    made: list[Pair] = []

    def make(name: str, **kw) -> Pair:
        made.append(Pair(model_dirs[name], **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def assert_same(got, want) -> None:
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]


def settle(pair: Pair) -> None:
    """Wait until the prefill loop has ended every transferred request (read between its steps),
    then check both engines' idle invariant."""
    pair.decode.check_memory()
    deadline = time.monotonic() + 30
    while True:
        with pair.prefill.between_steps():
            if not pair.prefill.has_pending():
                pair.prefill.scheduler.check_memory()
                return
        assert time.monotonic() < deadline, "the prefill engine did not end its transfers"
        time.sleep(0.01)


@pytest.mark.parametrize("name", ["llama", "qwen3", "stories"])
def test_pair_matches_one_engine_and_reuses_the_decode_cache(model_dirs, pair_of, name):
    ref = Engine(model_path=model_dirs[name])
    pair = pair_of(name)
    ids = prompts(ref, 10, seed=31, lo=3, hi=90)
    want = ref.generate(input_ids=ids, sampling_params=GREEDY)
    assert_same(pair.generate(ids, GREEDY), want)
    first = pair.decode.stats()
    assert first.kv_transfers == 10 and first.kv_transfer_tokens == sum(map(len, ids))
    # Again: the decode engine's own cache holds each prompt but its last token, so only that moves.
    assert_same(pair.generate(ids, GREEDY), want)
    second = pair.decode.stats()
    assert second.kv_transfer_tokens - first.kv_transfer_tokens == 10
    assert second.kv_skipped_tokens == sum(len(p) - 1 for p in ids)
    # Decode engines run PREBUILT batches and never compute a prompt; prefill engines never decode.
    modes, pmodes = second.batches_by_mode, pair.prefill.stats().batches_by_mode
    assert modes["PREBUILT"] > 0 and modes["EXTEND"] == modes["MIXED"] == 0 and modes["DECODE"] > 0
    assert pmodes["DECODE"] == pmodes["PREBUILT"] == 0 and pmodes["EXTEND"] > 0
    assert pair.prefill.stats().kv_transfer_bytes == second.kv_transfer_bytes
    settle(pair)


def test_shared_prefix_hits_the_prefill_cache(model_dirs, pair_of):
    """Requests sharing a long head: the prefill computes it once (its cache), the decode engine
    receives it once per request until its own cache has it."""
    pair = pair_of("llama")
    ref = Engine(model_path=model_dirs["llama"])
    head = prompts(ref, 1, seed=5, lo=80, hi=80)[0]
    ids = [head + tail for tail in prompts(ref, 6, seed=6, lo=2, hi=12)]
    want = ref.generate(input_ids=ids, sampling_params=GREEDY)
    assert_same(pair.generate(ids[:1], GREEDY), want[:1])
    assert_same(pair.generate(ids[1:], GREEDY), want[1:])
    assert pair.prefill.stats().cached_tokens >= 5 * len(head)
    assert pair.decode.stats().kv_skipped_tokens >= 5 * len(head)
    settle(pair)


def test_chunked_prefill_on_the_prefill_side(model_dirs, pair_of):
    ref = Engine(model_path=model_dirs["qwen3"])
    pair = pair_of("qwen3", prefill={"chunked_prefill_size": 7})
    ids = prompts(ref, 6, seed=32, lo=10, hi=60)
    assert_same(pair.generate(ids, GREEDY), ref.generate(input_ids=ids, sampling_params=GREEDY))
    assert pair.prefill.stats().batches_by_mode["EXTEND"] > len(ids)
    settle(pair)


def test_tight_decode_pool_waits_and_retracts_through_the_prefill(model_dirs, pair_of):
    """A decode pool too small for every request: pre-allocation waits for memory, and decoding
    retracts requests, whose KV comes back through the prefill engine (the decode engine still
    never extends). The first wave's KV all arrives before the decode engine decodes: with some
    still on its way, decoding would give those pre-allocations back instead of retracting."""
    path = model_dirs["stories"]
    ref = Engine(model_path=path)
    pair = pair_of("stories", decode={"max_total_tokens": 220})
    ids = prompts(ref, 12, seed=7, lo=20, hi=40)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    deltas: dict[str, list] = {str(i): [] for i in range(len(ids))}
    for i, x in enumerate(ids):
        pair.decode.submit(x, params, lambda d: deltas[d.rid].append(d), rid=str(i))
    pair.decode.step()  # pre-allocates the first wave and asks the prefill engine for its KV
    wave = list(pair.decode.scheduler.prealloc.transferring)
    assert 1 < len(wave) < len(ids)
    deadline = time.monotonic() + 60
    while any(r.kv_receiver.poll() != KVPoll.Success for r in wave):
        assert time.monotonic() < deadline, "the prefill engine did not send the first wave"
        time.sleep(0.01)
    while any(not d or d[-1].finish_reason is None for d in deltas.values()):
        assert time.monotonic() < deadline, "the decode engine did not finish"
        pair.decode.step()
        time.sleep(0.001)  # the prefill engine's thread needs the GIL between steps
    got = [collect_output(str(i), deltas[str(i)]) for i in range(len(ids))]
    assert_same(got, ref.generate(input_ids=ids, sampling_params=params))
    stats = pair.decode.stats()
    assert stats.num_retracted > 0 and stats.batches_by_mode["EXTEND"] == 0
    assert stats.kv_transfers > len(ids)  # the retracted requests' KV came back through the prefill
    settle(pair)


def test_overlap_and_ngram_speculation_on_the_decode_side(model_dirs, pair_of):
    ref = Engine(model_path=model_dirs["stories"])
    ids = prompts(ref, 8, seed=33, lo=5, hi=40)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    want = ref.generate(input_ids=ids, sampling_params=params)
    overlap = pair_of("stories", decode={"enable_overlap_schedule": True})
    assert_same(overlap.generate(ids, params), want)
    assert overlap.decode.stats().overlapped_steps > 0
    spec = pair_of("stories", decode={"speculative_algorithm": "ngram"})
    assert_same(spec.generate(ids, params), want)
    assert spec.decode.stats().batches_by_mode["TARGET_VERIFY"] > 0
    settle(overlap)
    settle(spec)


def test_json_schema_logprobs_and_seeded_sampling_match(model_dirs, pair_of):
    path = model_dirs["llama"]
    ref = Engine(model_path=path)
    pair = pair_of("llama")
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                         "additionalProperties": False})
    params = [SamplingParams(max_new_tokens=30, temperature=0.0, json_schema=schema),
              SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3, prompt_logprobs=2,
                             ignore_eos=True)]
    # n = 3 choices with seeds, as the HTTP front end sends them (one request per choice).
    params += [SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
               for i in range(3)]
    ids = prompts(ref, 1, seed=34, lo=12, hi=12) * len(params)
    want = ref.generate(input_ids=ids, sampling_params=params)
    got = pair.generate(ids, params)
    assert_same(got, want)
    assert got[0].finish_reason == "stop" and set(json.loads(got[0].text)) == {"a"}
    assert got[1].logprobs == want[1].logprobs and got[1].prompt_logprobs == want[1].prompt_logprobs
    assert len({tuple(o.token_ids) for o in got[2:]}) == 3
    settle(pair)


class FlakySource:
    """Fault injection: the first `fail` fetches break (the prefill engine 'dies' before or after
    the decode side bootstraps); `stall` fetches are never served (no prefill at all)."""

    def __init__(self, inner, fail: int = 0, when: str = "before", stall: int = 0) -> None:
        self.inner, self.fail, self.when, self.stall = inner, fail, when, stall
        self.fetches: list[KVFetch] = []

    def fetch(self, fetch: KVFetch):
        self.fetches.append(fetch)
        if self.stall:
            self.stall -= 1
            return LocalKVChannel()  # nobody will ever send
        if self.fail:
            self.fail -= 1
            channel = LocalKVChannel()
            if self.when == "before":
                channel.fail("injected: the prefill engine died")
                return channel
            return BreaksAfterBootstrap(channel)
        return self.inner.fetch(fetch)


class BreaksAfterBootstrap:
    """A channel whose prefill side dies once the decode side has pre-allocated."""

    def __init__(self, channel: LocalKVChannel) -> None:
        self.channel = channel

    def __getattr__(self, name):
        return getattr(self.channel, name)

    def bootstrap(self, skip: int) -> None:
        self.channel.bootstrap(skip)
        self.channel.fail("injected: the prefill engine died mid-transfer")


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failed_transfer_is_fetched_again(model_dirs, pair_of, when):
    ref = Engine(model_path=model_dirs["llama"])
    pair = pair_of("llama", source_wrapper=lambda s: FlakySource(s, fail=2, when=when))
    ids = prompts(ref, 3, seed=35, lo=5, hi=30)
    assert_same(pair.generate(ids, GREEDY), ref.generate(input_ids=ids, sampling_params=GREEDY))
    assert len(pair.source.fetches) == 5  # two broke and were fetched again
    settle(pair)


def test_transfers_that_keep_failing_or_stall_end_with_an_error(model_dirs, pair_of):
    pair = pair_of("llama", decode={"disaggregation_transfer_timeout_s": 0.3},
                   source_wrapper=lambda s: FlakySource(s, stall=3))
    out = pair.generate([[1, 5, 6, 7]], GREEDY)[0]
    assert out.finish_reason == "abort" and out.error_kind == "kv_transfer_failed" and "timed out" in out.error
    assert out.token_ids == []
    settle(pair)
    broken = pair_of("llama", source_wrapper=lambda s: FlakySource(s, fail=3))
    out = broken.generate([[1, 5, 6, 7]], GREEDY)[0]
    assert out.error_kind == "kv_transfer_failed" and "3 attempts" in out.error
    # The pair still serves, and holds no KV for the failed request.
    assert broken.generate([[1, 5, 6, 7]], GREEDY)[0].finish_reason == "length"
    settle(broken)


def test_aborts_on_either_side_free_the_kv(model_dirs, pair_of):
    pair = pair_of("llama", source_wrapper=lambda s: FlakySource(s, stall=1))
    got: list = []
    pair.decode.submit([1, 5, 6, 7, 8], GREEDY, got.append, rid="waits")  # its KV never comes
    for _ in range(3):
        pair.decode.step()
    assert pair.decode.stats().prealloc_queue == 1 and pair.decode.stats().kv_used > 0
    pair.decode.abort("waits")
    pair.decode.step()
    assert got[-1].finish_reason == "abort" and pair.decode.stats().prealloc_queue == 0
    pair.decode.check_memory()
    # A decode side that gives up fails the transfer: the prefill engine ends its request and keeps the prompt cached.
    channel = LocalKVChannel()
    ended: list = []
    pair.prefill.submit([1, 9, 9, 9, 9], GREEDY, ended.append, rid="p", kv_sender=channel)
    channel.fail("the decode engine went away")
    settle(pair)
    assert ended[-1].finish_reason == "abort" and ended[-1].error_kind == "kv_transfer_failed"
    assert channel.poll() == KVPoll.Failed


def test_roles_refuse_what_they_do_not_serve(model_dirs):
    path = model_dirs["llama"]
    with pytest.raises(ConfigError, match="kv_source"):
        Engine(model_path=path, disaggregation_mode="decode")
    prefill = Engine(model_path=path, disaggregation_mode="prefill")
    with pytest.raises(InvalidRequestError, match="kv_sender"):
        prefill.submit([1, 2, 3], GREEDY, lambda d: None)
    with pytest.raises(InvalidRequestError, match="kv_sender"):
        Engine(model_path=path).submit([1, 2, 3], GREEDY, lambda d: None, kv_sender=LocalKVChannel())
