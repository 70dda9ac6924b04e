"""The churn bench's yardsticks: the hit-rate ceilings it prints and its open-loop arrivals."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.bench import _Gate, hit_rate_ceilings, poisson_arrivals


def test_ceilings_on_a_cyclic_order():
    # Three tenants in a cycle through room for two: LRU always evicts the one needed next
    # (no hit); the optimal eviction keeps one of them (hits on the 4th and 6th request).
    optimal, lru = hit_rate_ceilings([0, 1, 2, 0, 1, 2], prefix_len=10, prompt_tokens=60, slots=2)
    assert lru == 0 and optimal == 20 / 60


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40), st.integers(1, 5))
def test_no_eviction_beats_the_optimal_one(order, slots):
    optimal, lru = hit_rate_ceilings(order, 1, max(len(order), 1), slots)
    assert lru <= optimal <= max(len(order) - len(set(order)), 0) / max(len(order), 1)


def test_open_loop_sends_each_request_at_its_arrival():
    arrivals = poisson_arrivals(200.0, 20)
    assert arrivals[0] == 0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
    assert 0.02 < arrivals[-1] < 0.4  # 19 gaps of 1/200 s on average

    async def run() -> list[tuple[float, float]]:
        gate = _Gate(1, time.perf_counter(), open_loop=True)

        async def one(at: float) -> tuple[float, float]:
            async with gate.slot(at) as t0:  # the clock starts at the arrival, not when a slot frees
                sent = time.perf_counter() - gate.start
                await asyncio.sleep(0.05)
                return t0 - gate.start, sent

        return await asyncio.gather(*(one(at) for at in arrivals))

    began = time.perf_counter()
    clocks, sent = zip(*asyncio.run(run()))
    assert list(clocks) == pytest.approx(arrivals) and all(s > a - 1e-3 for s, a in zip(sent, arrivals))
    assert time.perf_counter() - began < 0.9  # they overlap: one at a time would take over 1 s
