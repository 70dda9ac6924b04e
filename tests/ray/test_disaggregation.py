"""Prefill/decode disaggregation across engine actors: prefill engines compute prompts, decode
engines fetch the KV through Ray (actors/kv_transfer.py) and decode. Output is the same as one
engine's; faults (a prefill engine that dies or stalls, a decode engine that dies) end every
request and leak no KV on either side."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import ray

from cluster import ClusterConfig
from engine import SamplingParams
from engine.errors import ConfigError
from tests.helpers import prompts

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster_configs(model_dirs) -> dict[str, ClusterConfig]:
    def pd(name: str, p: int = 1, d: int = 1, **kw) -> ClusterConfig:
        return ClusterConfig(model_path=model_dirs[name], prefill_engines=p, decode_engines=d,
                             health_check_period_s=0.5, **kw)

    return {
        # Overlap on the decode side, chunked prefill on both, n-gram speculation: what a
        # disaggregated pair must keep working.
        "llama": pd("llama", engine={"chunked_prefill_size": 32, "enable_overlap_schedule": True}),
        # The p2p backend (a gloo link per engine pair) for the others.
        "qwen3": pd("qwen3", engine={"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3,
                                     "disaggregation_transfer_backend": "p2p"}),
        # Attention-DP on the decode side: one prefill engine, a lock-step group of two decode engines.
        "dp-decode": pd("llama", d=2, enable_dp_attention=True, routing="round_robin"),
        # Two prefill engines: a fetch that fails on one goes to the other; a stalled transfer
        # fails after its deadline.
        "two-prefill": pd("qwen2", p=2, request_timeout_s=120, engine={"disaggregation_transfer_timeout_s": 3.0,
                                                                       "disaggregation_transfer_backend": "p2p"}),
    }


def engine_stats(cl) -> dict[str, list]:
    by_role: dict[str, list] = {}
    for s in cl.stats().engines:
        by_role.setdefault(s.role, []).append(s.engine)
    return by_role


def test_batch_job_with_prefill_and_decode_engines(ray_local, single, model_dirs, tmp_path, capsys):
    """`python -m cluster batch --prefill-engines 1 --decode-engines 1`: the Generate stage's
    actors are decode engines fetching KV from the job's prefill engine; same rows as one engine.
    (First in the module: the job's engines need the CPUs the shared clusters take later.)"""
    from cluster.batch import main

    path = model_dirs["llama"]  # (no test data needed: every test here runs on a plain clone)
    texts = ["Once upon a time", "The little dog", "Once upon a time there was", "A cat sat", "Tom and Lily"]
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": t, "max_tokens": 12, "temperature": 0, "ignore_eos": True}) + "\n"
        for i, t in enumerate(texts)))
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--model", path,
            "--prefill-engines", "1", "--decode-engines", "1", "--no-progress",
            "--address", ray.get_runtime_context().gcs_address]
    assert main(args) == 0
    assert "batch: rows=5 errors=0" in capsys.readouterr().out
    rows = {r["id"]: r for f in sorted((tmp_path / "out").glob("part-*.jsonl"))
            for r in map(json.loads, f.read_text().splitlines())}
    ref = single(path).generate(prompt=texts, sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                             ignore_eos=True))
    assert [rows[f"r{i}"]["text"] for i in range(len(texts))] == [o.text for o in ref]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_one_prefill_and_one_decode_engine_match_one_engine(clusters, single, model_dirs, name):
    """Mixed prompt lengths, then the same prompts again: the second round hits the prefill
    engine's cache, and the decode engine, which holds them too, receives only what it lacks.
    The decode engine runs PREBUILT batches and never EXTEND; the prefill engine never decodes."""
    cl = clusters.get(name)
    ref_engine = single(model_dirs[name])
    ids = prompts(ref_engine, 6, seed=3, lo=3, hi=90)
    ref = [o.token_ids for o in ref_engine.generate(input_ids=ids, sampling_params=GREEDY)]
    before = engine_stats(cl)
    assert [o.token_ids for o in cl.generate(input_ids=ids, sampling_params=GREEDY)] == ref
    again = cl.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o.token_ids for o in again] == ref
    assert all(o.cached_tokens > 0 for o in again)
    after = engine_stats(cl)
    (p0,), (d0,), (p1,), (d1,) = before["prefill"], before["decode"], after["prefill"], after["decode"]
    assert d1.kv_transfers - d0.kv_transfers == 12 and p1.kv_transfers - p0.kv_transfers == 12
    # The second round's prompts were all cached on the decode engine: one token each crossed.
    assert d1.kv_skipped_tokens - d0.kv_skipped_tokens >= sum(len(p) - 1 for p in ids)
    assert d1.kv_transfer_tokens - d0.kv_transfer_tokens <= sum(len(p) for p in ids) + len(ids)
    assert p1.cached_tokens > p0.cached_tokens
    assert d1.kv_wire_seconds > d0.kv_wire_seconds and d1.kv_transfer_seconds > d0.kv_transfer_seconds
    assert d1.batches_by_mode["PREBUILT"] > d0.batches_by_mode["PREBUILT"]
    assert d1.batches_by_mode["EXTEND"] == d1.batches_by_mode["MIXED"] == 0
    assert p1.batches_by_mode["DECODE"] == 0
    if name == "qwen3":
        assert d1.batches_by_mode["TARGET_VERIFY"] > 0 and p1.batches_by_mode["TARGET_VERIFY"] == 0
    if name == "llama":
        assert d1.overlapped_steps > d0.overlapped_steps


def test_sampling_logprobs_and_json_schema_match_one_engine(clusters, single, model_dirs):
    """n = 3 seeded samples of one prompt (the decode side's RNG continues the prefill's stream), logprobs and
    prompt logprobs (computed by the prefill engine), a JSON-schema request (the decode side's
    grammar takes the prefill's first token)."""
    cl = clusters.get("llama")
    ref_engine = single(model_dirs["llama"])
    ids = prompts(ref_engine, 3, seed=5)
    ids = [ids[0]] * 3 + ids[1:]  # the first prompt three times (n = 3), each with its own seed
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, seed=11 + i, logprobs=True,
                              top_logprobs=2, prompt_logprobs=1) for i in range(len(ids))]
    ref = ref_engine.generate(input_ids=ids, sampling_params=sampled)
    out = cl.generate(input_ids=ids, sampling_params=sampled)
    assert len({tuple(o.token_ids) for o in out[:3]}) > 1, out[0]  # the seeds tell the samples apart
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    for o, r in zip(out, ref):
        assert [lp.token_id for lp in o.logprobs] == [lp.token_id for lp in r.logprobs]
        # (float32 sums in another order: the prefill engine computes the prompt in chunks)
        assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in r.logprobs], abs=1e-3)
        assert o.prompt_logprobs[0] is None and r.prompt_logprobs[0] is None
        assert [p.logprob for p in o.prompt_logprobs[1:]] == pytest.approx(
            [p.logprob for p in r.prompt_logprobs[1:]], abs=1e-3)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(max_new_tokens=40, temperature=0.0, json_schema=msgspec.json.encode(schema).decode())
    assert cl.generate(input_ids=ids[0], sampling_params=constrained).token_ids == \
        ref_engine.generate(input_ids=ids[0], sampling_params=constrained).token_ids


def test_an_attention_dp_group_of_decode_engines(clusters, single, model_dirs):
    """The decode engines step in lock-step (a member with nothing to decode runs IDLE); KV
    arrives as PREBUILT batches outside the group's steps; output as one engine's."""
    cl = clusters.get("dp-decode")
    ref_engine = single(model_dirs["llama"])
    ids = prompts(ref_engine, 4, seed=12)
    ref = [o.token_ids for o in ref_engine.generate(input_ids=ids, sampling_params=GREEDY)]
    assert [o.token_ids for o in cl.generate(input_ids=ids, sampling_params=GREEDY)] == ref
    assert cl.generate(input_ids=ids[0], sampling_params=GREEDY).token_ids == ref[0]  # the other member idles
    stats = cl.stats()
    decode = [s for s in stats.engines if s.role == "decode"]
    assert [s.dp_group for s in decode] == [0, 0] and all(s.dp is not None and s.dp.steps > 0 for s in decode)
    assert all(s.engine.batches_by_mode["PREBUILT"] > 0 and s.engine.batches_by_mode["EXTEND"] == 0 for s in decode)
    assert sum(s.engine.batches_by_mode["IDLE"] for s in decode) > 0
    assert [s.dp for s in stats.engines if s.role == "prefill"] == [None]
    assert [len(g.members) for g in cl.dp_stats()] == [2]


def test_streams_and_aborts(clusters):
    """A stream delivers as with unified engines; closing it early aborts the request on the
    decode engine (and frees its KV: the clusters fixture checks both engines' memory)."""
    cl = clusters.get("llama")

    async def first_tokens_then_leave() -> int:
        got = 0
        params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        async for d in cl.stream(input_ids=[1, 5, 6, 7, 8], sampling_params=params):
            got += len(d.token_ids)
            if got >= 3:
                break
        return got

    assert cl.run(first_tokens_then_leave()) >= 3
    deltas = []

    async def whole() -> None:
        async for d in cl.stream(input_ids=[1, 9, 10, 11], sampling_params=GREEDY):
            deltas.append(d)

    cl.run(whole())
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 24


def test_a_prefill_engine_that_dies_is_replaced_in_the_transfer(clusters, single, model_dirs):
    """A prefill engine dies on its next transfer: each request whose KV it was computing is
    fetched again from the other prefill engine and completes with the same tokens."""
    cl = clusters.get("two-prefill")
    ref_engine = single(model_dirs["qwen2"])
    ids = prompts(ref_engine, 6, seed=8, lo=20, hi=30)
    ref = [o.token_ids for o in ref_engine.generate(input_ids=ids, sampling_params=GREEDY)]
    doomed = next(e.actor for e in cl.engines if e.info.disaggregation_mode == "prefill")
    before = ray.get(doomed.incarnation_id.remote())
    ray.get(doomed.debug_fail_prefills.remote(["exit"]))
    assert [o.token_ids for o in cl.generate(input_ids=ids, sampling_params=GREEDY)] == ref
    cl.wait_healthy()
    assert ray.get(doomed.incarnation_id.remote()) != before  # it did get a transfer, and died


def test_a_stalled_transfer_fails_after_its_deadline_and_goes_elsewhere(clusters, single, model_dirs):
    cl = clusters.get("two-prefill")
    ref_engine = single(model_dirs["qwen2"])
    ids = prompts(ref_engine, 2, seed=9)
    ref = [o.token_ids for o in ref_engine.generate(input_ids=ids, sampling_params=GREEDY)]
    prefill = [e.actor for e in cl.engines if e.info.disaggregation_mode == "prefill"]
    ray.get(prefill[0].debug_fail_prefills.remote(["stall", "stall"]))
    t0 = time.monotonic()
    assert [o.token_ids for o in cl.generate(input_ids=ids, sampling_params=GREEDY)] == ref
    decode = engine_stats(cl)["decode"][0]
    assert decode.kv_transfers >= 2
    assert time.monotonic() - t0 < 60


def test_a_stall_everywhere_ends_with_an_explicit_error(clusters):
    cl = clusters.get("two-prefill")
    prefill = [e.actor for e in cl.engines if e.info.disaggregation_mode == "prefill"]
    ray.get([a.debug_fail_prefills.remote(["stall", "stall"]) for a in prefill])
    out = cl.generate(input_ids=[1, 20, 30, 40], sampling_params=GREEDY)
    assert out.finish_reason == "abort" and "attempts" in (out.error or ""), out


def test_a_decode_engine_that_dies_mid_stream_ends_the_request_with_an_error(clusters):
    cl = clusters.get("two-prefill")
    decode = next(e.actor for e in cl.engines if e.info.disaggregation_mode == "decode")

    async def stream_and_kill() -> list:
        deltas = []
        params = SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True)
        async for d in cl.stream(input_ids=[1, 5, 6], sampling_params=params):
            deltas.append(d)
            if len(deltas) == 2:
                ray.kill(decode, no_restart=False)
        return deltas

    deltas = cl.run(asyncio.wait_for(stream_and_kill(), 120))
    assert deltas[-1].finish_reason == "abort" and deltas[-1].error_kind == "engine_error", deltas[-1]
    cl.wait_healthy()


def test_config_needs_both_pools():
    with pytest.raises(ConfigError, match="prefill_engines and decode_engines"):
        ClusterConfig(prefill_engines=1)
    with pytest.raises(ConfigError, match="num_engines"):
        ClusterConfig(prefill_engines=1, decode_engines=1, num_engines=3)
    with pytest.raises(ConfigError, match="dp_group_size must divide"):
        ClusterConfig(prefill_engines=1, decode_engines=3, enable_dp_attention=True, dp_group_size=2)
    with pytest.raises(ConfigError, match="disaggregation_mode"):
        ClusterConfig(prefill_engines=1, decode_engines=1, engine={"disaggregation_mode": "decode"})
    cfg = ClusterConfig(prefill_engines=2, decode_engines=1)
    assert cfg.num_engines == 3 and [cfg.engine_role(i) for i in range(3)] == ["prefill", "prefill", "decode"]
