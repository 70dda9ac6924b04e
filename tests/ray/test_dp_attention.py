"""Attention-DP groups: lock-step engines with a split MLP, IDLE batches, waves, gang restart."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time

import msgspec
import pytest
import ray

from actors.dp_coordinator import DPCoordinator
from actors.engine_actor import EngineActor
from cluster import Cluster, ClusterConfig
from engine import Engine, GenerateOutput, SamplingParams
from engine.engine import collect_output
from tests.helpers import finals_after

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


def prompts_for(vocab: int, n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def dp_cluster(path: str, **engine) -> Cluster:
    return Cluster(ClusterConfig(model_path=path, num_engines=2, routing="round_robin", dp_attention=True,
                                 engine=engine))


@pytest.mark.parametrize("name", ["llama", "qwen3", "stories"])
def test_group_matches_single_engine(ray_local, model_dirs, name):
    path = model_dirs[name]
    single = Engine(model_path=path)
    ids = prompts_for(single.model_config.vocab_size, 6, seed=11)
    ref = single.generate(input_ids=ids, sampling_params=GREEDY)
    with dp_cluster(path) as cl:
        both = cl.generate(input_ids=ids, sampling_params=GREEDY)  # round robin: both members busy
        assert [o.token_ids for o in both] == [r.token_ids for r in ref]
        one = cl.generate(input_ids=ids[0], sampling_params=GREEDY)  # one member only
        assert one.token_ids == ref[0].token_ids
        stats = cl.stats()
        assert sum(e.engine.batches_by_mode["IDLE"] for e in stats.engines) > 0
        assert [e.dp_group for e in stats.engines] == [0, 0] and stats.dp_groups[0].waves_started >= 1
        assert all(e.dp.waves >= 1 for e in stats.engines)
        cl.check_memory()


def test_prefill_beside_decode_and_chunked(ray_local, model_dirs):
    path = model_dirs["stories"]
    single = Engine(model_path=path)
    long_prompt = prompts_for(512, 1, seed=3, lo=120, hi=120)[0]
    short = prompts_for(512, 1, seed=4)[0]
    params_long = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
    ref_a = single.generate(input_ids=short, sampling_params=params_long)
    ref_b = single.generate(input_ids=long_prompt, sampling_params=GREEDY)
    with dp_cluster(path, chunked_prefill_size=16) as cl:
        async def run():
            decoding = asyncio.Event()
            a = asyncio.create_task(_collect(cl, short, params_long, decoding))  # member 0 decodes...
            await decoding.wait()
            b = asyncio.create_task(_collect(cl, long_prompt, GREEDY))  # ...while member 1 prefills in chunks
            return await asyncio.gather(a, b)

        a, b = cl.run(run())
        assert a == ref_a.token_ids and b == ref_b.token_ids
        modes = [e.engine.batches_by_mode for e in cl.stats().engines]
        assert modes[1]["EXTEND"] >= 120 // 16  # chunked on member 1
        cl.check_memory()


async def _collect(cl: Cluster, ids: list[int], params: SamplingParams,
                   first_token: asyncio.Event | None = None) -> list[int]:
    tokens = []
    async for d in cl.stream_ids(ids, params):
        tokens += d.token_ids
        if first_token is not None and tokens:
            first_token.set()
    return tokens


def test_no_steps_without_work_then_a_wave(ray_local, model_dirs):
    with dp_cluster(model_dirs["stories"]) as cl:
        cl.generate(prompt="Once upon a time", sampling_params=GREEDY)
        waves = cl.dp_stats()[0].waves_started
        deadline = time.monotonic() + 30  # every member has finished the waves it was given
        while any(e.dp.waves < waves for e in cl.stats().engines):
            assert time.monotonic() < deadline, cl.stats().engines
            time.sleep(0.05)
        before = [e.dp.steps for e in cl.stats().engines]
        time.sleep(2.0)  # the window in which an idle group must not step
        assert [e.dp.steps for e in cl.stats().engines] == before  # nobody spins
        cl.generate(prompt="The cat", sampling_params=GREEDY)
        assert cl.dp_stats()[0].waves_started > waves
        assert all(e.dp.steps > b for e, b in zip(cl.stats().engines, before))
        cl.check_memory()


def test_killed_member_restarts_the_group(ray_local, model_dirs):
    path = model_dirs["stories"]
    ref = Engine(model_path=path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    cfg = ClusterConfig(model_path=path, num_engines=2, routing="round_robin", dp_attention=True,
                        request_timeout_s=120, health_check_period_s=0.5)
    with Cluster(cfg) as cl:
        long = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
        finals = cl.run(finals_after(cl, [f"Story {i}" for i in range(4)], long,
                                     lambda: ray.kill(cl.actors[1], no_restart=False)))
        assert len(finals) == 4 and all(f.finish_reason in ("length", "abort") for f in finals)
        assert any(f.error for f in finals)  # the group went down under them: explicit errors
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (all(cl.healthy()) and cl.dp_stats()[0].epoch >= 1
                                                   and len(cl.dp_stats()[0].members) == 2):
            time.sleep(0.5)
        assert all(cl.healthy()) and cl.dp_stats()[0].restarts >= 1
        again = cl.generate(prompt=["Once upon a time"] * 2, sampling_params=GREEDY)
        assert [o.token_ids for o in again] == [ref.token_ids] * 2, ([o.error for o in again], cl.dp_stats(), [o.token_ids for o in again], ref.token_ids, cl.stats().engines)
        cl.check_memory()


def test_other_group_keeps_serving(ray_local, model_dirs):
    path = model_dirs["stories"]
    ref = Engine(model_path=path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    cfg = ClusterConfig(model_path=path, num_engines=4, dp_group_size=2, routing="round_robin", dp_attention=True,
                        request_timeout_s=120, health_check_period_s=0.5)
    with Cluster(cfg) as cl:
        assert [g.members for g in cl.dp_stats()] == [[0, 1], [0, 1]], cl.dp_stats()
        ray.kill(cl.actors[0], no_restart=False)  # group 0 goes down...
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and cl.healthy()[0]:
            time.sleep(0.1)
        # ...while group 1 (engines 2 and 3) answers every request meanwhile.
        outs = cl.generate(prompt=["Once upon a time"] * 4, sampling_params=GREEDY)
        assert all(o.token_ids == ref.token_ids and o.error is None for o in outs)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(cl.healthy()):
            time.sleep(0.5)
        assert all(cl.healthy()) and cl.dp_stats()[0].restarts >= 1 and cl.dp_stats()[1].restarts == 0
        cl.check_memory()


def _timed(cl: Cluster, prompts: list[str], params: SamplingParams, within_s: float) -> list:
    """Generate, failing the test if any request is still open after within_s (a stalled group
    holds requests until request_timeout_s, 600 s by default). At the bound every stream is
    cancelled, which aborts its request."""
    async def one(prompt: str) -> GenerateOutput:
        deltas = [d async for d in cl.stream(prompt=prompt, sampling_params=params)]
        return collect_output(deltas[-1].rid, deltas)

    async def every() -> list[GenerateOutput]:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=within_s)

    return cl.run(every())


def _wait_idle(cl: Cluster) -> None:
    """Until every member has run every wave announced: the group sleeps, so the next request
    needs a new wave from the coordinator."""
    deadline = time.monotonic() + 30
    while any(e.dp.waves < cl.dp_stats()[0].waves_started or e.engine.running or e.engine.waiting
              for e in cl.stats().engines):
        assert time.monotonic() < deadline, (cl.dp_stats(), cl.stats().engines)
        time.sleep(0.05)


def test_group_survives_a_coordinator_restart(ray_local, model_dirs):
    """Ray restarts the coordinator under traffic: its members check back in, it adopts their
    epoch (no gang restart, no request lost), and the next requests get their waves."""
    path = model_dirs["stories"]
    ref = Engine(model_path=path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    cfg = ClusterConfig(model_path=path, num_engines=2, routing="round_robin", dp_attention=True,
                        health_check_period_s=0.5)  # request_timeout_s stays 600: a stall would hold requests
    with Cluster(cfg) as cl:
        coord = cl.coordinators[0]
        before = ray.get(coord.stats.remote())
        long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        finals = cl.run(finals_after(cl, [f"Story {i}" for i in range(4)], long,
                                     lambda: ray.kill(coord, no_restart=False), timeout_s=90))
        assert all(f.error is None and f.finish_reason == "length" for f in finals), finals
        for _ in range(3):  # each round starts from a sleeping group: a new wave from the new coordinator
            _wait_idle(cl)
            outs = _timed(cl, ["Once upon a time"] * 2, GREEDY, within_s=90)
            assert [o.token_ids for o in outs] == [ref.token_ids] * 2, [o.error for o in outs]
        after = cl.dp_stats()[0]
        assert after.coordinator != before.coordinator  # it was restarted...
        assert after.epoch == before.epoch and after.members == [0, 1] and after.rejoins == 2, after
        assert after.restarts == 0  # ...and the group it adopted went on
        cl.check_memory()


def test_a_lost_wave_request_is_retried(ray_local, model_dirs):
    path = model_dirs["stories"]
    ref = Engine(model_path=path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    with dp_cluster(path) as cl:
        coord = cl.coordinators[0]
        cl.generate(prompt="The cat", sampling_params=GREEDY)
        _wait_idle(cl)
        asked = sum(e.dp.wave_requests for e in cl.stats().engines)
        assert ray.get(coord.drop_wave_requests_for_tests.remote(1)) == 0
        out = _timed(cl, ["Once upon a time"], GREEDY, within_s=30)[0]
        assert out.token_ids == ref.token_ids, out.error
        assert ray.get(coord.drop_wave_requests_for_tests.remote(0)) == 0  # the request was lost...
        assert sum(e.dp.wave_requests for e in cl.stats().engines) >= asked + 2  # ...and asked again
        cl.check_memory()


def test_a_stalled_group_fails_and_restarts(ray_local, model_dirs):
    """No wave comes however often a member asks: after the stall bound (30 s) the member fails
    its health check and exits, its request ends with an error instead of waiting for
    request_timeout_s, and the group restarts and serves again."""
    path = model_dirs["stories"]
    ref = Engine(model_path=path).generate(prompt="Once upon a time", sampling_params=GREEDY)
    cfg = ClusterConfig(model_path=path, num_engines=2, routing="round_robin", dp_attention=True,
                        health_check_period_s=0.5)
    with Cluster(cfg) as cl:
        coord = cl.coordinators[0]
        cl.generate(prompt="The cat", sampling_params=GREEDY)
        _wait_idle(cl)
        ray.get(coord.drop_wave_requests_for_tests.remote(1_000_000))
        t0 = time.monotonic()
        out = _timed(cl, ["Once upon a time"], GREEDY, within_s=90)[0]
        assert out.error and not out.token_ids, out
        assert 25 < time.monotonic() - t0 < 90  # the stall bound, not request_timeout_s
        ray.get(coord.drop_wave_requests_for_tests.remote(0))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (all(cl.healthy()) and len(cl.dp_stats()[0].members) == 2):
            time.sleep(0.5)
        assert cl.dp_stats()[0].restarts >= 1
        outs = _timed(cl, ["Once upon a time"] * 2, GREEDY, within_s=90)
        assert [o.token_ids for o in outs] == [ref.token_ids] * 2, [o.error for o in outs]


def test_a_forming_group_is_not_an_error(ray_local, model_dirs):
    """A member whose group has not formed is not ready (False, not an error) and fails its health
    check; the cluster's wait for it logs nothing (an error it left unread would be logged as an
    unhandled one, with its traceback)."""
    cfg = ClusterConfig(model_path=model_dirs["stories"], num_engines=2, dp_attention=True)
    engine_cfg = msgspec.structs.asdict(cfg.engine_config("cpu"))
    # Two rank-0 members of two groups of two whose rank 1 never comes: they wait for their peer
    # (up to the rendezvous timeout, 30 s).
    actors = [ray.remote(EngineActor).options(num_cpus=0).remote(
        engine_cfg, i, {"rank": 0, "size": 2, "coordinator": ray.remote(DPCoordinator).remote(i, 2)})
        for i in range(2)]
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
            Cluster._wait_healthy(actors, timeout_s=3)
        gc.collect()
        time.sleep(1.0)  # unread errors are reported when their refs are freed
        assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    finally:
        logging.getLogger("ray").removeHandler(handler)
        for a in actors:
            ray.kill(a)
