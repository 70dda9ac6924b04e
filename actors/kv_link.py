"""Point-to-point KV links: a two-rank torch.distributed gloo group between a decode engine (rank
0, it hosts the rendezvous store) and one prefill engine (rank 1). The `p2p` transfer backend sends
a transfer's KV bytes over it, tagged with the transfer's number (gloo matches a receive to its
send by tag, whatever order the threads post them in), while only the metadata travels as the
prefill call's Ray result. The bytes are staged in host memory on CUDA engines too (NCCL would
match sends and receives by order, not by tag).

A link is set up lazily, on a decode engine's first fetch from that prefill engine: the decode
side binds the store on a port the OS picks and waits for its peer on a thread of its own; the fetch
carries the address, and the prefill side joins before it sends. A link that fails (its peer
died, a transfer timed out) is dropped and the next fetch sets up a new one."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from engine.tp.comm import make_store, serve_store


class LinkAddress(msgspec.Struct, frozen=True, array_like=True):
    """Where a decode engine waits for one prefill engine: its store and the link's id."""

    link_id: str
    host: str
    port: int


class KVLink:
    """One side of a two-rank group (rank 0: the decode engine, which hosts the store)."""

    def __init__(self, address: LinkAddress, rank: int, timeout_s: float, store: dist.Store | None = None) -> None:
        """`store`: rank 0's, already bound at `address` (`serve_address`); rank 1 joins it."""
        timeout = timedelta(seconds=timeout_s)
        self.address, self.rank = address, rank
        self.store = store if store is not None else make_store(
            f"tcp://{address.host}:{address.port}", rank, 2, timeout_s)
        self.pg = dist.ProcessGroupGloo(self.store, rank, 2, timeout)

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self.pg.send([tensor.contiguous().cpu()], 1 - self.rank, tag).wait()

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self.pg.recv([tensor], 1 - self.rank, tag).wait()


def serve_address(link_id: str, host: str, timeout_s: float) -> tuple[LinkAddress, dist.Store]:
    """A new link's address and rank 0's store, bound there before the peer is told of it."""
    store, _ = serve_store(host, 2, timeout_s)
    return LinkAddress(link_id, host, store.port), store


class DecodeLinks:
    """A decode engine's links, one per prefill engine (by actor name), each a Future that
    resolves once the peer has joined."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s
        self._lock = threading.Lock()
        self._links: dict[str, tuple[LinkAddress, Future]] = {}
        self._ids = itertools.count()
        self._tags = itertools.count()

    def address(self, peer: str) -> tuple[LinkAddress, Future]:
        """The link to `peer` (being set up, or up)."""
        with self._lock:
            if peer not in self._links:
                address, store = serve_address(f"{peer}#{next(self._ids)}", self.host, self.timeout_s)
                ready: Future = Future()

                def open_link() -> None:
                    try:
                        ready.set_result(KVLink(address, 0, self.timeout_s, store))
                    except BaseException as e:  # the peer never came
                        ready.set_exception(e)
                        self.drop(peer, address)

                threading.Thread(target=open_link, name="radixray-kv-link", daemon=True).start()
                self._links[peer] = (address, ready)
            return self._links[peer]

    def next_tag(self) -> int:
        return next(self._tags)

    def drop(self, peer: str, address: LinkAddress) -> None:
        """The link failed: the next fetch from `peer` sets up another."""
        with self._lock:
            if peer in self._links and self._links[peer][0] == address:
                del self._links[peer]


class PrefillLinks:
    """A prefill engine's links, one per decode engine's link id."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._links: dict[str, Future] = {}

    def join(self, address: LinkAddress) -> KVLink:
        """The link to the decode engine waiting at `address` (joined on first use; blocks)."""
        with self._lock:
            ready = self._links.get(address.link_id)
            first = ready is None
            if first:
                ready = self._links[address.link_id] = Future()
        if first:
            try:
                ready.set_result(KVLink(address, 1, self.timeout_s))
            except BaseException as e:
                ready.set_exception(e)
                with self._lock:
                    self._links.pop(address.link_id, None)
        return ready.result()

    def drop(self, address: LinkAddress) -> None:
        with self._lock:
            self._links.pop(address.link_id, None)
