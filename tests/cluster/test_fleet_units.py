"""Units of the fleet: stream coalescing's merge, the autoscaling policy, the fleet options, the
engines' eviction log that every front end reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.engine_actor import EvictionLog
from cluster.cluster import _merge_all
from deploy.engines import EngineAutoscaler
from deploy.options import FleetOptions
from engine import StreamDelta
from engine.engine import TokenLogprob
from engine.errors import ConfigError


def test_merged_deltas_carry_both_in_order():
    lp = [TokenLogprob(token_id=1, logprob=-0.5, top_logprobs=[])]
    a = StreamDelta(rid="r", text="ab", token_ids=[1, 2], completion_tokens=2, logprobs=lp * 2)
    b = StreamDelta(rid="r", text="c", token_ids=[3], completion_tokens=3, finish_reason="length", logprobs=lp)
    m = _merge_all([a, b])
    assert (m.text, m.token_ids, m.completion_tokens, m.finish_reason) == ("abc", [1, 2, 3], 3, "length")
    assert len(m.logprobs) == 3


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
