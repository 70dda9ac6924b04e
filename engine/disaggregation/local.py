"""A KV source of prefill engines in this process (tests, a single-process pair): each fetch goes
to the next prefill engine, over a LocalKVChannel."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import msgspec

from engine.disaggregation.transfer import KVFetch, KVReceiver, LocalKVChannel
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine, StreamDelta

# A fetch for KV only (a retracted request has its tokens): the prefill's one sampled token is unused.
KV_ONLY = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


class LocalPrefillSource:
    def __init__(self, prefill_engines: list[Engine]) -> None:
        self.prefill_engines = prefill_engines
        self._next = itertools.cycle(range(len(prefill_engines)))
        self._ids = itertools.count()

    def fetch(self, fetch: KVFetch) -> KVReceiver:
        channel = LocalKVChannel()
        params = fetch.sampling_params or KV_ONLY
        if fetch.seed is not None and not params.is_greedy:
            params = msgspec.structs.replace(params, seed=fetch.seed)

        def sink(delta: StreamDelta) -> None:
            if delta.finish_reason == "abort":  # the prefill failed (or was aborted): the decode side refetches
                channel.fail(delta.error or "the prefill failed")

        engine = self.prefill_engines[next(self._next)]
        engine.submit(fetch.token_ids, params, sink, rid=f"{fetch.rid}/kv{next(self._ids)}", kv_sender=channel)
        return channel
