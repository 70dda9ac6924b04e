"""A KV source of prefill engines in this process (tests, a single-process pair): each fetch goes
to the next prefill engine, over a LocalKVChannel."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from engine.disaggregation.prefill import submit_prefill
from engine.disaggregation.transfer import KVFetch, KVReceiver, LocalKVChannel

if TYPE_CHECKING:
    from engine.engine import Engine


class LocalPrefillSource:
    def __init__(self, prefill_engines: list[Engine]) -> None:
        self.prefill_engines = prefill_engines
        self._next = itertools.cycle(range(len(prefill_engines)))
        self._ids = itertools.count()

    def fetch(self, fetch: KVFetch) -> KVReceiver:
        channel = LocalKVChannel()
        engine = self.prefill_engines[next(self._next)]
        submit_prefill(engine, fetch, channel, rid=f"{fetch.rid}/kv{next(self._ids)}")
        return channel
