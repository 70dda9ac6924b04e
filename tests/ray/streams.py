"""Helper for fault tests: act (kill an engine) only once every request is mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cluster import Cluster
from engine import SamplingParams, StreamDelta


async def finals_after(cl: Cluster, prompts: list[str], params: SamplingParams, action: Callable[[], None],
                       timeout_s: float = 240) -> list[StreamDelta]:
    """Stream every prompt; once each has streamed a delta (and none has ended), run `action`;
    return each stream's last delta. A fixed sleep instead raced fast engines to the end."""
    streaming: set[int] = set()
    all_streaming = asyncio.Event()

    async def final(i: int) -> StreamDelta:
        deltas = []
        async for delta in cl.stream(prompt=prompts[i], sampling_params=params):
            deltas.append(delta)
            streaming.add(i)
            if len(streaming) == len(prompts):
                all_streaming.set()
        return deltas[-1]

    tasks = [asyncio.create_task(final(i)) for i in range(len(prompts))]
    await asyncio.wait_for(all_streaming.wait(), timeout=60)
    assert not any(t.done() for t in tasks), "a request ended before the action: make them longer"
    action()
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
