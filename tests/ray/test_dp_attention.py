"""Attention-DP groups: lock-step engines with a split MLP, IDLE batches, waves, gang restart,
structured outputs.

The tests share one cluster per configuration (tests/ray/conftest.py `clusters`): a test
measures the counters it asserts on as differences over its own run, and a fault test ends with
its group restarted and settled, so the next test starts from a healthy group."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import subprocess
import sys
import time

import jsonschema
import msgspec
import pytest
import ray

from actors.dp_coordinator import DPCoordinator
from actors.engine_actor import EngineActor
from cluster import Cluster, ClusterConfig
from cluster.health import wait_ready
from engine import Engine, GenerateOutput, SamplingParams
from engine.engine import collect_output
from tests.helpers import assert_greedy_agrees, finals_after, write_peft_adapters
from tests.ray.conftest import take_down_engine_0

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
# The stall bound of the "stories" group (its stall test waits it out; the default is 30 s).
STALL_S = 6.0


@pytest.fixture(scope="module")
def cluster_configs(model_dirs) -> dict[str, ClusterConfig]:
    def dp(name: str, **kw) -> ClusterConfig:
        return ClusterConfig(model_path=model_dirs[name], routing="round_robin", enable_dp_attention=True,
                             **{"num_engines": 2, **kw})

    return {
        "llama": dp("llama"),
        # Weights quantized at load (int4 blocks of 32): each member holds half of every MLP's
        # quantized blocks; the reference is one engine with the same quantized weights.
        "llama-int4": dp("llama", engine={"quantization": "int4"}),
        "qwen3": dp("qwen3"),
        # One group of two for the module's stories tests, the fault tests included: chunked
        # prefills (long prompts arrive in chunks beside decodes), quick health checks, a short
        # stall bound, and requests bounded well above what a restart takes.
        "stories": dp("stories", engine={"chunked_prefill_size": 16}, health_check_period_s=0.5,
                      request_timeout_s=120, dp_stall_timeout_s=STALL_S),
        # Two groups of two: one goes down (or loses its coordinator) while the other serves. Its
        # tests come after every "stories" test: four engines, so the pair is shut down for it.
        "stories-2x2": dp("stories", num_engines=4, dp_group_size=2, health_check_period_s=0.5,
                          request_timeout_s=120),
    }


def prompts_for(vocab: int, n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference(single, cl: Cluster, prompt: str = "Once upon a time") -> list[int]:
    return single(cl.config.model_path).generate(prompt=prompt, sampling_params=GREEDY).token_ids


def wait_restarted(cl: Cluster, group: int, before, timeout_s: float = 120) -> None:
    """Until the group has re-formed in an epoch after `before`'s (its DPGroupStats) and every
    engine is healthy again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            now = cl.dp_stats()[group]
        except Exception:  # a coordinator restarting
            now = None
        if (now is not None and now.epoch > before.epoch and len(now.members) == len(before.members)
                and all(cl.healthy())):
            break
        time.sleep(0.2)
    assert all(cl.healthy()) and cl.dp_stats()[group].restarts > before.restarts, cl.dp_stats()


def mode_diff(after, before, mode: str) -> list[int]:
    return [a.engine.batches_by_mode[mode] - b.engine.batches_by_mode[mode] for a, b in zip(after, before)]


@pytest.mark.parametrize("name", ["llama-int4", "qwen3", "llama", "stories"])  # llama's serves the next test too
def test_group_matches_single_engine(clusters, single, name):
    cl = clusters.get(name)
    quantization = cl.config.engine.get("quantization")
    engine = single(cl.config.model_path) if quantization is None else Engine(
        model_path=cl.config.model_path, quantization=quantization)
    ids = prompts_for(engine.model_config.vocab_size, 6, seed=11)
    ref = engine.generate(input_ids=ids, sampling_params=msgspec.structs.replace(GREEDY, logprobs=True, top_logprobs=2))
    before = cl.stats()
    both = cl.generate(input_ids=ids, sampling_params=GREEDY)  # round robin: both members busy
    for got, want in zip(both, ref):
        assert_greedy_agrees(got.token_ids, want)
    one = cl.generate(input_ids=ids[0], sampling_params=GREEDY)  # one member only
    assert_greedy_agrees(one.token_ids, ref[0])
    after = cl.stats()
    assert sum(mode_diff(after.engines, before.engines, "IDLE")) > 0
    assert [e.dp_group for e in after.engines] == [0, 0]
    assert after.dp_groups[0].waves_started > before.dp_groups[0].waves_started
    assert all(a.dp.waves > b.dp.waves for a, b in zip(after.engines, before.engines))


SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["k", "n"], "additionalProperties": False}


def test_dp_group_constrained_matches_single_engine(clusters, single):
    """Structured outputs: the lock-step members mask their own requests; the group's
    constrained outputs are the single engine's."""
    cl = clusters.get("llama")
    rng = random.Random(3)
    ids = [[1] + [rng.randrange(5, 261) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=200, temperature=0.0, json_schema=json.dumps(SCHEMA)),
              SamplingParams(max_new_tokens=30, temperature=0.0, regex="[a-z]{3}-[0-9]{2}")] * 2
    ref = single(cl.config.model_path).generate(input_ids=ids, sampling_params=params)
    outs = cl.generate(input_ids=ids, sampling_params=params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o in outs[::2]:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_group_serves_lora_adapters(clusters, model_dirs, tmp_path_factory):
    """LoRA adapters under attention-DP through the cluster: every member holds each adapter of
    lora_paths in the same slot; requests of two adapters and of the base model, spread over
    both members, give one engine's greedy tokens (up to near-ties)."""
    pytest.importorskip("peft", reason="needs peft (python3 -m pip install --no-deps peft)")
    path = model_dirs["llama"]
    folders = write_peft_adapters(path, tmp_path_factory.mktemp("dp_loras"), {
        "all8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]),
        "mlp4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])}, seed=42)
    clusters.configs["llama-lora"] = ClusterConfig(model_path=path, routing="round_robin", enable_dp_attention=True,
                                                   num_engines=2, engine={"lora_paths": folders})
    engine = Engine(model_path=path, lora_paths=folders)
    ids = prompts_for(engine.model_config.vocab_size, 6, seed=13)
    names = ["all8", None, "mlp4", "all8", "mlp4", None]
    params = msgspec.structs.replace(GREEDY, logprobs=True, top_logprobs=2)
    ref = [engine.generate(input_ids=x, sampling_params=params, lora_name=n) for x, n in zip(ids, names)]
    engine.shutdown()
    cl = clusters.get("llama-lora")
    try:
        for got, want in zip(cl.generate(input_ids=ids, sampling_params=GREEDY, lora_name=names), ref):
            assert got.finish_reason == "length", got.error
            assert_greedy_agrees(got.token_ids, want)
    finally:
        clusters.close("llama-lora")  # (its two engines make room for the next tests' groups)


def test_prefill_beside_decode_and_chunked(clusters, single):
    cl = clusters.get("stories")
    engine = single(cl.config.model_path)  # unchunked: the group's chunks change no token
    long_prompt = prompts_for(512, 1, seed=3, lo=120, hi=120)[0]
    short = prompts_for(512, 1, seed=4)[0]
    params_long = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
    ref_a = engine.generate(input_ids=short, sampling_params=params_long)
    ref_b = engine.generate(input_ids=long_prompt, sampling_params=GREEDY)
    before = cl.stats().engines

    async def run():
        decoding = asyncio.Event()
        a = asyncio.create_task(_collect(cl, short, params_long, decoding))  # one member decodes...
        await decoding.wait()
        b = asyncio.create_task(_collect(cl, long_prompt, GREEDY))  # ...while the other prefills in chunks
        return await asyncio.gather(a, b)

    a, b = cl.run(run())
    assert a == ref_a.token_ids and b == ref_b.token_ids
    after = cl.stats().engines
    assert [x.engine.num_received - y.engine.num_received for x, y in zip(after, before)] == [1, 1]
    prompt_tokens = [x.engine.prompt_tokens - y.engine.prompt_tokens for x, y in zip(after, before)]
    prefiller = prompt_tokens.index(len(long_prompt))
    assert mode_diff(after, before, "EXTEND")[prefiller] >= len(long_prompt) // 16  # chunked there


async def _collect(cl: Cluster, ids: list[int], params: SamplingParams,
                   first_token: asyncio.Event | None = None) -> list[int]:
    tokens = []
    async for d in cl.stream_ids(ids, params):
        tokens += d.token_ids
        if first_token is not None and tokens:
            first_token.set()
    return tokens


def test_no_steps_without_work_then_a_wave(clusters):
    cl = clusters.get("stories")
    cl.generate(prompt="Once upon a time", sampling_params=GREEDY)
    waves = cl.dp_stats()[0].waves_started
    deadline = time.monotonic() + 30  # every member has finished the waves it was given
    while any(e.dp.waves < waves for e in cl.stats().engines):
        assert time.monotonic() < deadline, cl.stats().engines
        time.sleep(0.05)
    before = [e.dp.steps for e in cl.stats().engines]
    time.sleep(1.0)  # the window in which an idle group must not step (its loop wakes every 0.5 s)
    assert [e.dp.steps for e in cl.stats().engines] == before  # nobody spins
    cl.generate(prompt="The cat", sampling_params=GREEDY)
    assert cl.dp_stats()[0].waves_started > waves
    assert all(e.dp.steps > b for e, b in zip(cl.stats().engines, before))


def test_killed_member_restarts_the_group(clusters, single):
    cl = clusters.get("stories")
    ref = reference(single, cl)
    before = cl.dp_stats()[0]
    long = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
    finals = cl.run(finals_after(cl, [f"Story {i}" for i in range(4)], long,
                                 lambda: ray.kill(cl.actors[1], no_restart=False)))
    assert len(finals) == 4 and all(f.finish_reason in ("length", "abort") for f in finals)
    assert any(f.error for f in finals)  # the group went down under them: explicit errors
    wait_restarted(cl, 0, before)
    again = cl.generate(prompt=["Once upon a time"] * 2, sampling_params=GREEDY)
    assert [o.token_ids for o in again] == [ref] * 2, ([o.error for o in again], cl.dp_stats())


def _timed(cl: Cluster, prompts: list[str], params: SamplingParams, within_s: float) -> list:
    """Generate, failing the test if any request is still open after within_s (a stalled group
    holds requests until request_timeout_s). At the bound every stream is cancelled, which
    aborts its request."""
    async def one(prompt: str) -> GenerateOutput:
        deltas = [d async for d in cl.stream(prompt=prompt, sampling_params=params)]
        return collect_output(deltas[-1].rid, deltas)

    async def every() -> list[GenerateOutput]:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=within_s)

    return cl.run(every())


def _wait_idle(cl: Cluster) -> None:
    """Until every member has run every wave its group announced: the groups sleep, so the next
    request needs a new wave from its coordinator."""
    size = cl.config.dp_group_size or cl.config.num_engines
    deadline = time.monotonic() + 30
    while True:
        waves = [g.waves_started for g in cl.dp_stats()]
        engines = cl.stats().engines
        if not any(e.dp.waves < waves[i // size] or e.engine.running or e.engine.waiting
                   for i, e in enumerate(engines)):
            return
        assert time.monotonic() < deadline, (waves, engines)
        time.sleep(0.05)


def test_a_lost_wave_request_is_retried(clusters, single):
    cl = clusters.get("stories")
    ref = reference(single, cl)
    coord = cl.coordinators[0]
    cl.generate(prompt="The cat", sampling_params=GREEDY)
    _wait_idle(cl)
    asked = sum(e.dp.wave_requests for e in cl.stats().engines)
    assert ray.get(coord.drop_wave_requests_for_tests.remote(1)) == 0
    out = _timed(cl, ["Once upon a time"], GREEDY, within_s=30)[0]
    assert out.token_ids == ref, out.error
    assert ray.get(coord.drop_wave_requests_for_tests.remote(0)) == 0  # the request was lost...
    assert sum(e.dp.wave_requests for e in cl.stats().engines) >= asked + 2  # ...and asked again


def test_a_stalled_group_fails_and_restarts(clusters, single):
    """No wave comes however often a member asks: after the stall bound the member fails its
    health check and exits, its request ends with an error instead of waiting for
    request_timeout_s, and the group restarts and serves again."""
    cl = clusters.get("stories")
    ref = reference(single, cl)
    coord = cl.coordinators[0]
    cl.generate(prompt="The cat", sampling_params=GREEDY)
    _wait_idle(cl)
    before = cl.dp_stats()[0]
    ray.get(coord.drop_wave_requests_for_tests.remote(1_000_000))
    t0 = time.monotonic()
    out = _timed(cl, ["Once upon a time"], GREEDY, within_s=90)[0]
    assert out.error and not out.token_ids, out
    # The stall bound (the member's clock starts within its last idle check, 0.5 s before),
    # not request_timeout_s.
    assert STALL_S - 1 < time.monotonic() - t0 < 90 < cl.config.request_timeout_s
    ray.get(coord.drop_wave_requests_for_tests.remote(0))
    wait_restarted(cl, 0, before)
    outs = _timed(cl, ["Once upon a time"] * 2, GREEDY, within_s=90)
    assert [o.token_ids for o in outs] == [ref] * 2, [o.error for o in outs]


def test_group_survives_a_coordinator_restart(clusters, single):
    """Ray restarts a coordinator under traffic: its members check back in, it adopts their
    epoch (no gang restart, no request lost), and the next requests get their waves."""
    cl = clusters.get("stories-2x2")
    ref = reference(single, cl)
    coord = cl.coordinators[0]
    before = ray.get(coord.stats.remote())
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    finals = cl.run(finals_after(cl, [f"Story {i}" for i in range(4)], long,  # one on each engine
                                 lambda: ray.kill(coord, no_restart=False), timeout_s=90))
    assert all(f.error is None and f.finish_reason == "length" for f in finals), finals
    for _ in range(3):  # each round starts from sleeping groups: new waves, group 0's from the new coordinator
        _wait_idle(cl)
        outs = _timed(cl, ["Once upon a time"] * 4, GREEDY, within_s=90)  # round robin: one per engine
        assert [o.token_ids for o in outs] == [ref] * 4, [o.error for o in outs]
    after = cl.dp_stats()[0]
    assert after.coordinator != before.coordinator  # it was restarted...
    assert after.epoch == before.epoch and after.members == [0, 1] and after.rejoins == 2, after
    assert after.restarts == 0  # ...and the group it adopted went on


def test_other_group_keeps_serving(clusters, single):
    cl = clusters.get("stories-2x2")
    ref = reference(single, cl)
    before = cl.dp_stats()
    assert [g.members for g in before] == [[0, 1], [0, 1]], before
    take_down_engine_0(cl)  # group 0 goes down...
    # ...while group 1 (engines 2 and 3) answers every request meanwhile.
    outs = cl.generate(prompt=["Once upon a time"] * 4, sampling_params=GREEDY)
    assert all(o.token_ids == ref and o.error is None for o in outs), [o.error for o in outs]
    wait_restarted(cl, 0, before[0])
    assert cl.dp_stats()[1].restarts == before[1].restarts


def test_a_coordinator_process_imports_no_engine():
    """A coordinator's process (new, or restarted by Ray) imports actors.dp_coordinator alone:
    not the engine, nor torch, which would take seconds of its start."""
    code = "import sys, actors.dp_coordinator; print(sorted({'engine', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_a_forming_group_is_not_an_error(ray_local, model_dirs):
    """A member whose group has not formed is not ready (False, not an error) and fails its health
    check; the cluster's wait for it logs nothing (an error it left unread would be logged as an
    unhandled one, with its traceback)."""
    cfg = ClusterConfig(model_path=model_dirs["stories"], num_engines=2, enable_dp_attention=True)
    engine_cfg = msgspec.structs.asdict(cfg.engine_config("cpu"))
    # Two rank-0 members of two groups of two whose rank 1 never comes: they wait for their peer
    # (up to the rendezvous timeout, 30 s).
    coordinators = [ray.remote(DPCoordinator).remote(i, 2) for i in range(2)]
    actors = [ray.remote(EngineActor).options(num_cpus=0).remote(
        engine_cfg, i, {"rank": 0, "size": 2, "coordinator": coordinators[i]}) for i in range(2)]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ray").addHandler(handler)  # where Ray's driver reports unread errors
    try:
        ray.get([a.info.remote() for a in actors])
        assert ray.get([a.ready.remote() for a in actors]) == [False, False]
        with pytest.raises(ray.exceptions.RayTaskError, match="still joining"):
            ray.get(actors[0].check_health.remote())
        records.clear()
        with pytest.raises(TimeoutError):
            wait_ready(actors, timeout_s=1)  # what Cluster waits with (a bound: it asks until then)
        gc.collect()
        time.sleep(1.0)  # unread errors are reported when their refs are freed
        assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    finally:
        logging.getLogger("ray").removeHandler(handler)
        for a in actors + coordinators:
            ray.kill(a)
