"""The KV transfer contract between a prefill and a decode engine, and its in-process backend.

One transfer moves one request's KV: the decode side pre-allocates slots for the tokens its own
cache lacks and says how many it has (`bootstrap(skip)`); the prefill side, once its prompt is
computed, sends the KV of tokens `[skip:]` in one contiguous buffer with what the decode side
needs to go on (the first token, its logprob, the sampler's RNG state, prompt logprobs). Both
sides poll the transfer's state, as SGLang's `KVPoll`. Backends that need Ray (the object store,
collectives) live in `actors/`; the engine knows only this contract."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import msgspec
import torch

from engine.sampling import SamplingParams

# A fetch for KV only (a retracted request has its tokens): the prefill's one sampled token is unused.
KV_ONLY = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


class KVPoll(IntEnum):
    """A transfer's state, as either side sees it."""

    Failed = 0
    Bootstrapping = 1  # the decode side has not pre-allocated yet (the sender waits to learn `skip`)
    WaitingForInput = 2  # pre-allocated: the sender may send
    Transferring = 3  # sent, not yet received
    Success = 4


@dataclass
class KVPayload:
    """What one transfer carries. `kv` is [2, layers, tokens, kv_heads, head_dim]: the K and V of
    tokens `start:start + tokens` of the request's sequence."""

    start: int
    kv: torch.Tensor
    first_token: int | None = None  # None: the decode side has its tokens (a retracted request)
    first_logprob: Any = None  # the sampler's logprob row of the first token (None unless asked)
    generator_state: torch.Tensor | None = None  # the request's RNG after sampling the first token
    prompt_logprobs: list | None = None
    cached_tokens: int = 0  # prompt tokens the prefill engine's cache served
    sent_at: float = 0.0  # time.time() when the prefill engine handed it over (the transfer's start)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class KVFetch(msgspec.Struct, frozen=True):
    """A decode engine's request for KV: compute `token_ids` and send the KV of `[skip:]`.
    `sampling_params` None: KV only (a retracted request that has its tokens); else the prefill
    samples the first token with them (and the RNG seeded as the decode side's request)."""

    rid: str
    token_ids: list[int]
    skip: int
    sampling_params: SamplingParams | None
    seed: int | None = None  # the decode side's sampling seed (prefill and decode draw from one stream)

    def prefill_params(self) -> SamplingParams:
        """What the prefill engine samples its one token with."""
        params = self.sampling_params or KV_ONLY
        if self.seed is not None and not params.is_greedy:
            params = msgspec.structs.replace(params, seed=self.seed)
        return params


class KVSender(Protocol):
    """The prefill side of one transfer."""

    def poll(self) -> KVPoll: ...

    def skip(self) -> int:
        """Tokens the decode side already holds (valid from WaitingForInput on)."""

    def send(self, payload: KVPayload) -> None: ...

    def fail(self, reason: str) -> None:
        """The prefill side gives up (abort, error): the decode side sees Failed."""

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback` (any thread) when the state changes: the engine's loop wakes up."""


class KVReceiver(Protocol):
    """The decode side of one transfer."""

    def bootstrap(self, skip: int) -> None:
        """Slots are pre-allocated; the decode side holds the first `skip` tokens itself."""

    def poll(self) -> KVPoll: ...

    def take(self) -> KVPayload:
        """The payload (once Success)."""

    def fail(self, reason: str) -> None:
        """The decode side gives up (abort, deadline): the prefill side sees Failed."""

    def failure(self) -> str | None:
        """Why the transfer failed (None unless Failed)."""

    def on_change(self, callback: Callable[[], None]) -> None: ...


class KVSource(Protocol):
    """Where a decode engine gets KV: starts the prefill of `fetch` (on a prefill engine it
    chooses) and returns the receiving end. Called on the decode engine's step thread."""

    def fetch(self, fetch: KVFetch) -> KVReceiver: ...


class LocalKVChannel:
    """One transfer between two engines of one process: both ends are this object (the payload
    is handed over by reference; the sender's buffer is its own copy of the KV)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = KVPoll.Bootstrapping
        self._skip = 0
        self._payload: KVPayload | None = None
        self._failure: str | None = None
        self._callbacks: list[Callable[[], None]] = []

    def _set(self, state: KVPoll, **fields: Any) -> None:
        with self._lock:
            if self._state in (KVPoll.Failed, KVPoll.Success):
                return  # a finished transfer stays as it ended
            for name, value in fields.items():  # before the state: a reader that sees it sees them
                setattr(self, name, value)
            self._state = state
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def on_change(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def poll(self) -> KVPoll:
        return self._state

    # ---- the decode side ----
    def bootstrap(self, skip: int) -> None:
        self._set(KVPoll.WaitingForInput, _skip=skip)

    def take(self) -> KVPayload:
        assert self._payload is not None, "take() before Success"
        payload, self._payload = self._payload, None
        return payload

    def failure(self) -> str | None:
        return self._failure

    # ---- the prefill side ----
    def skip(self) -> int:
        return self._skip

    def send(self, payload: KVPayload) -> None:
        self._set(KVPoll.Success, _payload=payload)

    def fail(self, reason: str) -> None:
        self._set(KVPoll.Failed, _failure=reason)
