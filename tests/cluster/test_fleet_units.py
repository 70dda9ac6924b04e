"""Units of the fleet: the output channels (stream coalescing's merge, delivery to the engine a
request is on, the consumer's incarnation check), the autoscaling policy, the fleet options, the
engines' eviction log that every front end reads."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from actors.engine_actor import EvictionLog
from actors.protocol import encode_batch
from cluster.channels import ENGINE_DIED, Channels, Inbox, consume_outputs, merge_deltas
from cluster.membership import EngineSlot
from deploy.engines import EngineAutoscaler
from deploy.options import FleetOptions
from engine import StreamDelta
from engine.engine import TokenLogprob
from engine.errors import ConfigError


def test_merged_deltas_carry_both_in_order():
    lp = [TokenLogprob(token_id=1, logprob=-0.5, top_logprobs=[])]
    a = StreamDelta(rid="r", text="ab", token_ids=[1, 2], completion_tokens=2, logprobs=lp * 2)
    b = StreamDelta(rid="r", text="c", token_ids=[3], completion_tokens=3, finish_reason="length", logprobs=lp)
    m = merge_deltas([a, b])
    assert (m.text, m.token_ids, m.completion_tokens, m.finish_reason) == ("abc", [1, 2, 3], 3, "length")
    assert len(m.logprobs) == 3



def test_a_late_message_about_an_earlier_engine_is_dropped():
    """A request re-routed from engine 0 to engine 1 reads only engine 1's deliveries: a
    dead-engine signal for its first attempt, noticed late, cannot fail the healthy engine."""
    async def scenario() -> tuple[list, list]:
        channels = Channels(threading.Lock())
        first, second = Inbox(), Inbox()
        loop = asyncio.get_running_loop()
        with channels.lock:
            channels.subscribe_locked("r", 0, loop, first)
        channels.unsubscribe("r")
        with channels.lock:
            channels.subscribe_locked("r", 1, loop, second)  # the re-routed attempt
        assert channels.engine_of("r") == 1 and channels.subs["r"] == (1, loop, second)
        channels.deliver("r", ENGINE_DIED, 0)  # engine 0's stream broke, noticed only now
        channels.deliver("r", "token from engine 1", 1)
        return await asyncio.wait_for(second.take(), timeout=5), first.items

    assert asyncio.run(scenario()) == (["token from engine 1"], [])
    channels = Channels(threading.Lock())
    channels.unsubscribe("never-subscribed")  # a request that ended before it was routed
    assert (channels.subs, channels.where, channels.incarnation) == ({}, {}, {})


class _Method:
    """An actor method as a Ray handle exposes it: `.remote(...)`."""

    def __init__(self, fn) -> None:
        self.remote = fn


class _ScriptedEngine:
    """Stands in for an engine actor's handle in consume_outputs: its output stream yields
    `batches` (each one engine step's deltas) and then breaks; incarnation_id answers `live`, or
    fails as a dead actor's call does when `live` is None. Reopened after the break, the stream
    closes the cluster, which ends the consumer."""

    def __init__(self, batches: list[list[StreamDelta]], live: str | None, closed: threading.Event,
                 meanwhile=lambda: None) -> None:
        self.opened = 0

        async def outputs(consumer: str):
            assert consumer == "frontend-1"
            self.opened += 1
            if self.opened > 1:
                closed.set()
                raise ConnectionError("cluster closed")
            for batch in batches:
                yield asyncio.sleep(0, result=encode_batch(batch))  # an object ref: awaited, gives bytes
            raise ConnectionError("the engine died")

        async def incarnation_id() -> str:
            meanwhile()  # what the front end does while the consumer waits for the answer
            if live is None:
                raise ConnectionError("the engine is restarting")
            return live

        self.outputs = _Method(outputs)
        self.incarnation_id = _Method(incarnation_id)


def _tokens(rid: str, *ids: int) -> StreamDelta:
    return StreamDelta(rid=rid, text="", token_ids=list(ids))


async def _consume_after_a_break(live: str | None) -> dict[str, list]:
    """Engine 0's stream delivers a step, then breaks. On engine 0: "old" (taken by instance A,
    the one that died), "new" (taken by instance B, Ray's restart), "pending" (its submit has not
    answered yet), "late" (routed there while the consumer asks which instance is live);
    "elsewhere" is on engine 1. Returns what each request's inbox got."""
    loop = asyncio.get_running_loop()
    channels = Channels(threading.Lock())
    inboxes = {rid: Inbox() for rid in ("old", "new", "pending", "elsewhere", "late")}
    late = inboxes.pop("late")
    with channels.lock:
        for rid, inbox in inboxes.items():
            channels.subscribe_locked(rid, 1 if rid == "elsewhere" else 0, loop, inbox)
    channels.taken("old", "A")
    channels.taken("new", "B")
    channels.taken("elsewhere", "A")
    closed = threading.Event()
    step = [_tokens("old", 5), _tokens("new", 7), _tokens("elsewhere", 9)]  # the last one: not engine 0's

    def route_late() -> None:
        with channels.lock:
            channels.subscribe_locked("late", 0, loop, late)

    engine = _ScriptedEngine([step], live, closed, route_late)
    await asyncio.wait_for(consume_outputs(EngineSlot(engine, None, "engine-0"), 0, "frontend-1", channels, closed),
                           timeout=30)
    await asyncio.sleep(0)  # deliveries are callbacks on this loop
    assert engine.opened == 2  # the stream was reopened after the break
    return {rid: inbox.items for rid, inbox in {**inboxes, "late": late}.items()}


def test_a_break_noticed_after_the_restart_fails_only_the_dead_instances_requests():
    """The engine was restarted before its consumer saw the break: the requests the new instance
    took (or is taking) go on; only the dead instance's requests get the engine-died signal."""
    got = asyncio.run(_consume_after_a_break(live="B"))
    assert got == {"old": [_tokens("old", 5), ENGINE_DIED], "new": [_tokens("new", 7)], "pending": [],
                   "elsewhere": [], "late": []}


def test_a_break_with_no_live_instance_fails_every_request_it_may_have_held():
    """No instance answers: every request routed to the engine before the break was noticed is
    lost; one routed after it is not (its submit reaches the restarted instance, or fails)."""
    got = asyncio.run(_consume_after_a_break(live=None))
    assert got == {"old": [_tokens("old", 5), ENGINE_DIED], "new": [_tokens("new", 7), ENGINE_DIED],
                   "pending": [ENGINE_DIED], "elsewhere": [], "late": []}

def ctx(n: int, waiting: list[float], running: list[float], kv: list[float], lo: int = 1, hi: int = 8):
    metrics = {"waiting": dict(enumerate(waiting)), "running": dict(enumerate(running)), "kv_use": dict(enumerate(kv))}
    return SimpleNamespace(current_num_replicas=n, target_num_replicas=n, aggregated_metrics=metrics,
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi)


def test_autoscaler_grows_on_queues_and_kv_and_shrinks_when_light():
    policy = EngineAutoscaler(target_waiting_per_engine=2, target_kv_use=0.8)
    assert policy(ctx(2, [6, 6], [4, 4], [0.3, 0.3]))[0] == 6  # 12 waiting at 2 per engine
    assert policy(ctx(2, [0, 0], [4, 4], [0.9, 0.95]))[0] == 3  # KV past the target: one more
    assert policy(ctx(2, [1, 1], [4, 4], [0.5, 0.5]))[0] == 2  # within the targets: stay
    assert policy(ctx(3, [0, 0, 0], [1, 0, 0], [0.05, 0, 0]))[0] == 2  # light: one fewer at a time
    assert policy(ctx(1, [0], [0], [0]))[0] == 1  # never under the minimum
    assert policy(ctx(8, [50] * 8, [4] * 8, [1.0] * 8))[0] == 8  # never over the maximum
    gang = EngineAutoscaler(target_waiting_per_engine=2, target_kv_use=0.8, gang_size=2)
    assert gang(ctx(2, [3, 3], [2, 2], [0.2, 0.2]))[0] == 4  # whole DP groups
    assert gang(ctx(4, [0] * 4, [0] * 4, [0] * 4), )[0] == 2


def test_prefill_pool_scales_on_waiting_prompt_tokens():
    policy = EngineAutoscaler(target_waiting_per_engine=4096, target_kv_use=0.8, waiting_metric="waiting_tokens")
    busy = ctx(1, [1], [0], [0.2])
    busy.aggregated_metrics["waiting_tokens"] = {0: 12000.0}  # three engines' worth of prompts
    assert policy(busy)[0] == 3
    calm = ctx(2, [1, 1], [0, 0], [0.2, 0.2])
    calm.aggregated_metrics["waiting_tokens"] = {0: 5000.0, 1: 0.0}  # more than one engine's worth: stay
    assert policy(calm)[0] == 2
    calm.aggregated_metrics["waiting_tokens"] = {0: 1000.0, 1: 0.0}  # one engine would do
    assert policy(calm)[0] == 1


def test_pool_autoscaling_deploys_each_pool_on_its_own_signal():
    from deploy.app import build_app
    from deploy.engines import engine_deployment
    from deploy.options import AppArgs

    args = AppArgs.from_dict({"prefill_engines": 1, "decode_engines": 2, "max_prefill_engines": 3,
                              "max_decode_engines": 4})
    prefill = engine_deployment(args.cluster, args.fleet, "prefill")
    decode = engine_deployment(args.cluster, args.fleet, "decode")
    assert prefill.name == "PrefillServer" and decode.name == "DecodeServer"
    p, d = prefill._deployment_config.autoscaling_config, decode._deployment_config.autoscaling_config
    assert (p.min_replicas, p.max_replicas, d.min_replicas, d.max_replicas) == (1, 3, 2, 4)
    assert p.policy.policy_kwargs["waiting_metric"] == "waiting_tokens"
    assert "waiting_metric" not in d.policy.policy_kwargs
    assert type(build_app({"prefill_engines": 1, "decode_engines": 1})).__name__ == "Application"
    with pytest.raises(ConfigError, match="max_prefill_engines"):
        AppArgs.from_dict({"max_prefill_engines": 2})
    with pytest.raises(ConfigError, match="max_decode_engines"):
        AppArgs.from_dict({"prefill_engines": 1, "decode_engines": 3, "max_decode_engines": 2})
    with pytest.raises(ConfigError, match="min_engines/max_engines"):
        AppArgs.from_dict({"prefill_engines": 1, "decode_engines": 1, "min_engines": 1, "max_engines": 2})


def test_fleet_options_are_checked():
    with pytest.raises(ConfigError, match="together"):
        FleetOptions(min_engines=1)
    with pytest.raises(ConfigError, match="min_engines <= max_engines"):
        FleetOptions(min_engines=3, max_engines=2)
    with pytest.raises(ConfigError, match="frontends"):
        FleetOptions(frontends=0)
    assert FleetOptions(min_engines=1, max_engines=4).autoscaled and not FleetOptions().autoscaled


def test_every_reader_of_the_eviction_log_gets_every_eviction():
    log = EvictionLog()
    a = b = log.seq
    for k in range(5):
        log.append([k, k])
        a, got, lost = log.after(a)  # one front end heartbeats after each eviction
        assert got == [[k, k]] and not lost
    b, got, lost = log.after(b)  # another, once: nothing was taken from it by the first
    assert got == [[k, k] for k in range(5)] and not lost and a == b == 5
    assert log.after(b) == (5, [], False)


def test_the_eviction_log_is_bounded_and_a_reader_that_fell_behind_is_told():
    log = EvictionLog(max_paths=3, max_tokens=100)
    for k in range(4):
        log.append([k])
    assert log.after(0) == (4, [[1], [2], [3]], True)  # eviction 1 was dropped
    assert log.after(1) == (4, [[1], [2], [3]], False)
    assert log.after(7)[2]  # a cursor from some other instance cannot be trusted either
    log = EvictionLog(max_paths=100, max_tokens=10)
    for k in range(3):
        log.append([k] * 4)
    assert log.tokens == 8 and log.after(0) == (3, [[k] * 4 for k in range(3)][1:], True)  # 12 > 10 tokens
    assert log.after(1) == (3, [[1] * 4, [2] * 4], False)
