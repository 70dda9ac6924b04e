"""KV transfer between engine actors over Ray (prefill/decode disaggregation).

The decode engine orchestrates, as in Ray Serve LLM's current PD design: its scheduler asks its
KVSource for a request's KV once it has pre-allocated the slots, so it asks only when it has room
and only for what its own cache lacks (`skip`); the source calls the prefill engine actor that the
front end chose (`EngineActor.prefill_kv`), which computes the prompt, samples the first token and
returns the KV as the call's result. A front end sends each request once, to its decode engine,
as with unified engines, so streams, aborts, timeouts and `n` work unchanged; a prefill engine
never holds KV for a decode engine with no room for it.

Backends (`disaggregation_transfer_backend`): "object_store", the call's result carries the KV
through Ray's object store (one contiguous buffer per transfer, read in place on the same node);
"p2p", the result carries only the metadata and the KV goes over a point-to-point link between the
two engines (actors/kv_link.py: gloo, staged in host memory). Either way the prefill engine's KV
is copied into one buffer when it is handed over, so it returns to the prefill's cache at once."""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np
import ray
import torch

from actors.kv_link import DecodeLinks
from actors.protocol import KVPayloadMeta
from engine.config import DisaggregationTransferBackend
from engine.disaggregation import KVFetch, KVPayload, KVPoll, KVReceiver, LocalKVChannel

MAX_REMEMBERED_RIDS = 65536  # per-request routing hints and failed peers kept (oldest dropped)


def payload_meta(payload: KVPayload) -> bytes:
    """The payload's metadata (msgpack), its KV buffer's shape and dtype included."""
    kv, state = payload.kv, payload.generator_state
    return msgspec.msgpack.encode(KVPayloadMeta(
        start=payload.start, kv_shape=list(kv.shape), kv_dtype=str(kv.dtype).removeprefix("torch."),
        first_token=payload.first_token, first_logprob=payload.first_logprob,
        generator_state=state.numpy().tobytes() if state is not None else None,
        prompt_logprobs=payload.prompt_logprobs, cached_tokens=payload.cached_tokens, sent_at=payload.sent_at))


def kv_bytes(kv: torch.Tensor) -> torch.Tensor:
    """The KV buffer as flat bytes (any dtype, bfloat16 included, crosses as uint8)."""
    return kv.detach().contiguous().reshape(-1).view(torch.uint8)


def payload_to_wire(payload: KVPayload) -> tuple[bytes, np.ndarray]:
    """For the object store: (msgpack metadata, the KV as a host uint8 array)."""
    return payload_meta(payload), kv_bytes(payload.kv).cpu().numpy()


def decode_meta(meta_bytes: bytes) -> KVPayloadMeta:
    return msgspec.msgpack.decode(meta_bytes, type=KVPayloadMeta)


def payload_from_wire(meta: KVPayloadMeta, raw: np.ndarray | torch.Tensor) -> KVPayload:
    """The payload from its metadata and its KV bytes (a read-only object-store array, or a tensor)."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():  # the object store's buffers are read-only; scatter_kv only reads them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            raw = torch.from_numpy(raw)
    kv = raw.view(getattr(torch, meta.kv_dtype)).reshape(meta.kv_shape)
    state = (torch.frombuffer(bytearray(meta.generator_state), dtype=torch.uint8)
             if meta.generator_state is not None else None)
    return KVPayload(start=meta.start, kv=kv, first_token=meta.first_token, first_logprob=meta.first_logprob,
                     generator_state=state, prompt_logprobs=meta.prompt_logprobs, cached_tokens=meta.cached_tokens,
                     sent_at=meta.sent_at)


def kv_nbytes(meta: KVPayloadMeta) -> int:
    return math.prod(meta.kv_shape) * getattr(torch, meta.kv_dtype).itemsize


class RayKVReceiver:
    """The decode side of one transfer: the prefill actor's call, whose result is the payload."""

    def __init__(self, ref: ray.ObjectRef, peer: str, on_failure: Any, link: Any = None) -> None:
        """link: (DecodeLinks, LinkAddress, Future of the KVLink, tag) when the KV comes over a
        point-to-point link rather than in the call's result."""
        self.channel = LocalKVChannel()
        self.ref: ray.ObjectRef | None = ref  # dropped once done: the object store may free the KV
        self.peer = peer
        self._given_up = False  # the decode side failed it: its cancellation says nothing of the peer
        self._on_failure = on_failure  # (peer) -> None: the source avoids it for this request's next try
        self._link = link
        ref.future().add_done_callback(self._done)

    def _done(self, future: Any) -> None:
        self.ref = None
        try:
            meta, raw = future.result()
        except BaseException as e:  # the prefill engine died, refused, or the call was cancelled
            self._failed(e)
            return
        if self._link is None:
            self.channel.send(payload_from_wire(decode_meta(meta), raw))
            return
        # The link's receive blocks until the bytes are in: not on Ray's callback thread.
        threading.Thread(target=self._receive, args=(meta,), name="radixray-kv-recv", daemon=True).start()

    def _receive(self, meta_bytes: bytes) -> None:
        links, address, ready, tag = self._link
        try:
            meta = decode_meta(meta_bytes)
            link = ready.result(timeout=links.timeout_s)
            buffer = torch.empty(kv_nbytes(meta), dtype=torch.uint8)
            link.recv(buffer, tag)
            self.channel.send(payload_from_wire(meta, buffer))
        except BaseException as e:  # the peer died mid-transfer, or the link timed out: a new link next time
            links.drop(self.peer, address)
            self._failed(e)

    def _failed(self, error: BaseException) -> None:
        if not self._given_up:
            self._on_failure(self.peer)
        self.channel.fail(f"prefill engine {self.peer}: {type(error).__name__}: {str(error)[:200]}")

    def bootstrap(self, skip: int) -> None:
        self.channel.bootstrap(skip)  # (the fetch carried `skip` already)

    def poll(self) -> KVPoll:
        return self.channel.poll()

    def take(self) -> KVPayload:
        return self.channel.take()

    def failure(self) -> str | None:
        return self.channel.failure()

    def on_change(self, callback: Any) -> None:
        self.channel.on_change(callback)

    def fail(self, reason: str) -> None:
        """The decode side gives up (abort, deadline, memory): the prefill stops and frees its KV."""
        self._given_up = True
        ref = self.ref
        if ref is not None and self.channel.poll() not in (KVPoll.Success, KVPoll.Failed):
            ray.cancel(ref)
        self.channel.fail(reason)


class RayPrefillSource:
    """A decode engine's KVSource: the prefill engine actors it knows by name (in `namespace`;
    a handle is looked up on first use). A request goes to the one its front end chose (`hint`);
    a fetch after a failure to another one, if there is another."""

    def __init__(self, backend: DisaggregationTransferBackend, namespace: str, peers: list[str] = (),
                 timeout_s: float = 60.0) -> None:
        self.backend = backend
        self.namespace = namespace
        self.links = DecodeLinks(ray.util.get_node_ip_address(), timeout_s) if backend == "p2p" else None
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}  # prefill actor name -> handle (None: not looked up yet)
        self._hints: OrderedDict[str, str] = OrderedDict()  # rid -> the peer its front end chose
        self._failed: OrderedDict[str, set[str]] = OrderedDict()  # rid -> peers that failed it
        self._turn = itertools.count()
        self._ids = itertools.count()
        self.set_peers(list(peers))

    def set_peers(self, names: list[str]) -> None:
        """The prefill engines to fetch from (the full set: one left out is forgotten)."""
        with self._lock:
            self._handles = {n: self._handles.get(n) for n in names}

    @property
    def peers(self) -> list[str]:
        return sorted(self._handles)

    def hint(self, rid: str, peer: str) -> None:
        with self._lock:
            self._hints[rid] = peer
            while len(self._hints) > MAX_REMEMBERED_RIDS:
                self._hints.popitem(last=False)

    def _choose(self, rid: str) -> str:
        with self._lock:
            if not self._handles:
                raise RuntimeError("no prefill engine is known")
            failed = self._failed.get(rid, set())
            hinted = self._hints.pop(rid, None)
            if hinted in self._handles and hinted not in failed:
                return hinted
            names = sorted(self._handles)
            fresh = [n for n in names if n not in failed] or names
            return fresh[next(self._turn) % len(fresh)]

    def _handle(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            handle = ray.get_actor(name, namespace=self.namespace)
            with self._lock:
                if name in self._handles:
                    self._handles[name] = handle
        return handle

    def _failed_on(self, rid: str) -> Any:
        def record(peer: str) -> None:
            with self._lock:
                self._failed.setdefault(rid, set()).add(peer)
                while len(self._failed) > MAX_REMEMBERED_RIDS:
                    self._failed.popitem(last=False)
        return record

    def fetch(self, fetch: KVFetch) -> KVReceiver:
        name = self._choose(fetch.rid)
        kv_rid = f"{fetch.rid}/kv{next(self._ids)}"
        try:
            handle = self._handle(name)
        except Exception as e:  # not (yet, or any more) registered: this attempt fails, the next goes elsewhere
            self._failed_on(fetch.rid)(name)
            failed = LocalKVChannel()
            failed.fail(f"prefill engine {name} not found: {type(e).__name__}")
            return failed
        if self.links is None:
            ref = handle.prefill_kv.remote(msgspec.msgpack.encode(fetch), kv_rid)
            return RayKVReceiver(ref, name, self._failed_on(fetch.rid))
        address, ready = self.links.address(name)
        tag = self.links.next_tag()
        ref = handle.prefill_kv.remote(msgspec.msgpack.encode(fetch), kv_rid, msgspec.msgpack.encode(address), tag)
        return RayKVReceiver(ref, name, self._failed_on(fetch.rid), (self.links, address, ready, tag))
