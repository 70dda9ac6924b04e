"""The churn bench's yardsticks: the hit-rate ceilings it prints, its pacing of requests (open
loop: Poisson arrivals; closed loop: a fixed number in flight), timed on a virtual clock, and its
trace at other lengths."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cluster.bench as bench
from cluster.bench import _Gate, churn_workload, hit_rate_ceilings, poisson_arrivals


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


def test_a_longer_churn_trace_begins_as_the_default_one():
    prompts, outs, order = churn_workload(0.125)
    long_prompts, long_outs, long_order = churn_workload(0.125, requests=3 * len(prompts))
    assert len(long_prompts) == len(long_order) == len(long_outs) == 3 * len(prompts)
    assert long_order[:len(order)] == order  # the same tenants, in the same order, first
    cut = len(prompts[0]) // 2  # inside the tenant's document, before the question
    documents = {t: p[:cut] for t, p in zip(order, prompts)}
    assert all(documents.get(t, p[:cut]) == p[:cut] for t, p in zip(long_order, long_prompts))
    assert len(set(long_order)) >= len(set(order))


@pytest.mark.parametrize("tier", [None, 4.0])
@pytest.mark.parametrize("rate", [None, 2.0])
def test_churn_report_with_and_without_the_tier(monkeypatch, capsys, tier, rate):
    """The churn case's report over stand-in runs (no cluster): every line for each setting, and
    the first wave cut from each run before the TTFTs after it are pooled."""
    n = len(churn_workload(0.125)[0])
    seen = []

    def fake(*args, **kwargs):  # TTFT k + 1 for request k: the first wave's are the shortest
        seen.append(args)
        return 1.0, [k + 1.0 for k in range(n)], 0.5, [k % 2 for k in range(n)]

    monkeypatch.setattr(bench, "_fleet_run", fake)
    monkeypatch.setattr(bench, "_serve_router_run", fake)
    bench.case_churn("unused", 0.125, frontends=(2,), rate=rate, hicache_ratio=tier, repeat=2)
    out = capsys.readouterr().out
    assert len(seen) == 2 * (6 if tier else 4)  # with the tier, two baselines without it too
    assert out.count("2 runs pooled") == (4 if tier else 3) - (rate is not None)
    assert ("kv_events with the host tier" in out) == bool(tier)
    waves = [line for line in out.splitlines() if "after the first wave" in line]
    if rate is not None:
        assert not waves  # an open loop has no first wave
        return
    # Each run's requests after the first 16 (16 in flight): TTFTs 17..n; pooled, twice each.
    after = [float(t) for t in range(17, n + 1)]
    p90s = [1e3 * bench.percentile(after, 0.9)] * 2 + [1e3 * bench.percentile(after * 2, 0.9)]
    label = "kv_events, host tier 4x" if tier else "kv_events"
    assert len(waves) == 3 and all(f"{label} {p90:.0f} ms" in w for w, p90 in zip(waves, p90s)), waves


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: when every task waits, its clock jumps to the next timer
    instead of sleeping, so a schedule of sleeps takes no real time and every time it reads is
    exact, however loaded the machine. Code that holds the loop moves the clock itself (`now`)."""

    def __init__(self, start: float) -> None:
        self.now = start
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if not events:
            if timeout is None:  # no timer and nothing ready: a real loop would wait forever
                raise RuntimeError("every task waits on something that never comes")
            self.loop.now += timeout
        return events


def run_virtual(body: Callable[[VirtualTimeLoop], Coroutine[Any, Any, Any]], start: float = 100.0) -> tuple[Any, float]:
    """body(loop)'s result on a virtual-time loop, and the virtual seconds it took."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(body(loop)), loop.time() - start
    finally:
        loop.close()


SERVICE = 0.05  # virtual seconds each request holds its slot


def test_poisson_arrivals():
    arrivals = poisson_arrivals(200.0, 20)
    assert arrivals[0] == 0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
    assert 0.02 < arrivals[-1] < 0.4  # 19 gaps of 1/200 s on average
    assert poisson_arrivals(200.0, 20) == arrivals and poisson_arrivals(200.0, 20, seed=8) != arrivals


def paced(arrivals: list[float], width: int, open_loop: bool, hold_loop: dict[int, float] | None = None):
    """Requests through one gate, each holding its slot SERVICE s (request k first holds the
    whole loop hold_loop[k] s, as a client busy on the CPU would): per request, when its clock
    started and when it was sent, both from the gate's start."""
    async def body(loop: VirtualTimeLoop) -> list[tuple[float, float]]:
        gate = _Gate(width, loop.time(), open_loop, clock=loop.time)

        async def one(k: int, at: float) -> tuple[float, float]:
            async with gate.slot(at) as t0:
                sent = loop.time() - gate.start
                loop.now += (hold_loop or {}).get(k, 0.0)
                await asyncio.sleep(SERVICE)
                return t0 - gate.start, sent

        return await asyncio.gather(*(one(k, at) for k, at in enumerate(arrivals)))

    results, elapsed = run_virtual(body)
    clocks, sent = zip(*results)
    return list(clocks), list(sent), elapsed


def test_open_loop_sends_each_request_at_its_arrival():
    arrivals = poisson_arrivals(200.0, 20)
    clocks, sent, elapsed = paced(arrivals, width=1, open_loop=True)
    assert clocks == pytest.approx(arrivals, abs=1e-9)  # each clock starts at its arrival
    assert sent == pytest.approx(arrivals, abs=1e-9)  # none early, none waiting for a slot
    # They overlap: one at a time (width 1) would take 20 x SERVICE.
    assert elapsed == pytest.approx(arrivals[-1] + SERVICE, abs=1e-9)


def test_open_loop_clocks_start_at_the_arrival_when_the_client_is_late():
    # The client holds the loop 0.2 s in the first request: the next two go out late, but their
    # time counts from when they were due (no coordinated omission); the last one is on time.
    arrivals = [0.0, 0.1, 0.15, 0.5]
    clocks, sent, _ = paced(arrivals, width=1, open_loop=True, hold_loop={0: 0.2})
    assert clocks == pytest.approx(arrivals, abs=1e-9)
    assert sent == pytest.approx([0.0, 0.2, 0.2, 0.5], abs=1e-9)


def test_closed_loop_clocks_start_when_a_slot_frees():
    clocks, sent, elapsed = paced([0.0] * 5, width=2, open_loop=False)
    assert clocks == pytest.approx([0.0, 0.0, SERVICE, SERVICE, 2 * SERVICE], abs=1e-9)
    assert sent == clocks and elapsed == pytest.approx(3 * SERVICE, abs=1e-9)
