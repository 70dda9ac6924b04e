"""TPGroup: the collectives of one tensor-parallel engine's ranks, on process groups private to
the engine (never torch.distributed's default group, which other code in the process may own):

- the device group (gloo on the CPU, NCCL on CUDA) for the model's tensors: `all_reduce` after
  each row-parallel projection and the vocabulary-parallel embedding, `all_gather` of the LM
  head's vocabulary shards;
- a second gloo group for Python objects (`broadcast_object`: the scheduler's per-step batch
  metadata from rank 0), as SGLang's `tp_cpu_group`: host data never round-trips through the
  GPU, and the scheduler thread's broadcasts never interleave with the forward thread's
  collectives (under overlap scheduling both run at once; one group would see them in a
  different order on different ranks).

A single-rank group creates no process group and every call returns at once. Bound to graph
operators (`engine.tp.graph_ops.GraphCollectives`), a group traces its tensor collectives as
those operators, so a compiled decode graph holds them (engine/cpu_graph.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import msgspec
import torch
import torch.distributed as dist

from engine.tp.graph_ops import all_gather, all_reduce_

_HEADER = 8  # broadcast_object: payload length, little-endian, ahead of the payload


def make_store(init_method: str, tp_rank: int, tp_size: int, timeout_s: float = 30.0) -> dist.Store:
    """The rendezvous store of an explicit `init_method`: `tcp://host:port` (rank 0 serves a
    TCPStore there) or `file:///path` (a FileStore; the file must be fresh for each group)."""
    url = urlparse(init_method)
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r} needs a host and a port")
        return dist.TCPStore(
            url.hostname, url.port, tp_size, tp_rank == 0, timeout=timedelta(seconds=timeout_s)
        )
    if url.scheme == "file":
        return dist.FileStore(url.path, tp_size)
    raise ValueError(f"init_method must be tcp://host:port or file:///path, got {init_method!r}")


def serve_store(host: str, world: int, timeout_s: float = 30.0) -> tuple[dist.Store, str]:
    """Rank 0's TCPStore for a group of `world` (a TP engine's ranks, an attention-DP group) on a
    port the OS picks, bound before any other rank is told where it is (a port probed free and
    bound later can be taken in between); returns the store and the `tcp://host:port` init
    method for the other ranks."""
    store = dist.TCPStore(
        host, 0, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, f"tcp://{host}:{store.port}"


class TPGroup:
    """Rank `tp_rank` of a `tp_size`-rank tensor-parallel group (an object: nothing
    process-global). Give `init_method` (`make_store`) or a ready `store`; every rank must use
    the same one. Collectives block until every rank joins them; a peer that never does raises
    after `timeout_s` (a dead rank: the gang restarts). Each group takes its calls from one
    thread, in the same order on every rank: tensor collectives (`all_reduce`, `all_gather`,
    `broadcast`) from the forward thread, `broadcast_object` and `barrier` from the scheduler's.
    On CUDA the group makes its device the current one (the rank's CUDA graphs capture and
    replay there). A collective replayed inside a CUDA graph has no timeout (NCCL's watchdog
    does not see captured work): a dead peer is noticed by the gang's watcher instead."""

    def __init__(
        self,
        tp_rank: int,
        tp_size: int,
        device: torch.device | str = "cpu",
        *,
        init_method: str | None = None,
        store: dist.Store | None = None,
        timeout_s: float = 30.0,
        object_buffer_bytes: int = 16 << 10,
        object_timeout_s: float | None = None,
    ) -> None:
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
        if object_buffer_bytes <= _HEADER:
            raise ValueError(f"object_buffer_bytes must exceed {_HEADER}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        # Time waiting in the tensor collectives (the bench's split of a step; on CUDA only the
        # launch: NCCL's wait orders streams, it does not block the host; a replayed CUDA graph's
        # collectives are not counted) and in the object broadcasts, kept apart because two
        # threads update them.
        self.collective_seconds, self.collective_calls = 0.0, 0
        self.object_seconds, self.object_calls = 0.0, 0
        self.pg: dist.ProcessGroup | None = None
        self.cpu_pg: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self._destroyed = False
        # The handle compiled graphs name this group by (graph_ops.GraphCollectives); None: unbound.
        self.graph_handle: int | None = None
        self._rendezvous_count = 0
        if tp_size == 1:
            return
        if (init_method is None) == (store is None):
            raise ValueError("a TPGroup of several ranks needs exactly one of init_method or store")
        self._store = (
            store if store is not None else make_store(init_method, tp_rank, tp_size, timeout_s)
        )
        timeout = timedelta(seconds=timeout_s)
        # The object group may wait longer (`object_timeout_s`): a rank other than 0 waits there
        # for the next step however long the engine stays idle.
        object_timeout = timedelta(seconds=object_timeout_s or timeout_s)
        # Prefixed: the two groups (and any other user of the store) must not share keys.
        self.cpu_pg = dist.ProcessGroupGloo(
            dist.PrefixStore("radixray-tp/cpu/", self._store), tp_rank, tp_size, object_timeout
        )
        dev_store = dist.PrefixStore("radixray-tp/dev/", self._store)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # The rank's capture streams and graph replays follow the current device: this rank's.
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(dev_store, tp_rank, tp_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(dev_store, tp_rank, tp_size, timeout)
        # One broadcast per step for metadata up to this size (a second one only for the rest).
        self._obj_buf = torch.empty(object_buffer_bytes, dtype=torch.uint8)

    @property
    def is_first_rank(self) -> bool:
        return self.tp_rank == 0

    @property
    def cuda_graph_capturable(self) -> bool:
        """Whether a CUDA graph may hold this group's tensor collectives as they are: NCCL's on
        CUDA, from 2.9.6 (which captures them); one rank has none."""
        if self.tp_size == 1:
            return True
        return self.device.type == "cuda" and tuple(torch.cuda.nccl.version()) >= (2, 9, 6)

    def _group(self, cpu: bool = False) -> dist.ProcessGroup:
        if self._destroyed:
            raise RuntimeError("TPGroup was destroyed")
        pg = self.cpu_pg if cpu else self.pg
        assert pg is not None
        return pg

    def _wait(self, work: Any, objects: bool = False) -> None:
        t0 = time.perf_counter()
        work.wait()
        if objects:
            self.object_seconds += time.perf_counter() - t0
            self.object_calls += 1
        else:
            self.collective_seconds += time.perf_counter() - t0
            self.collective_calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (RowParallelLinear's reduction); returns `x`."""
        if self.tp_size == 1:
            return x
        if self.graph_handle is not None and torch.compiler.is_compiling():
            all_reduce_(x, self.graph_handle)  # an opaque node of the graph
            return x
        return self.all_reduce_now(x)

    def all_reduce_now(self, x: torch.Tensor) -> torch.Tensor:
        """`all_reduce` run now (what the graph operator calls)."""
        pg = self._group()
        if x.is_contiguous():
            self._wait(pg.allreduce([x]))
            return x
        buf = x.contiguous()
        self._wait(pg.allreduce([buf]))
        return x.copy_(buf)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order (the vocabulary shards of the
        logits); a new tensor."""
        if self.tp_size == 1:
            return x
        if self.graph_handle is not None and torch.compiler.is_compiling():
            stacked = all_gather(x, self.graph_handle, self.tp_size)
            return torch.cat(stacked.unbind(0), dim=dim)
        x = x.contiguous()
        outs = x.new_empty((self.tp_size, *x.shape))
        self.all_gather_into(outs, x)
        return torch.cat(outs.unbind(0), dim=dim)

    def all_gather_into(self, out: torch.Tensor | Sequence[torch.Tensor], x: torch.Tensor) -> None:
        """Rank r's `x` into `out[r]` (contiguous, x's shape and dtype), every rank's."""
        pg = self._group()
        self._wait(pg.allgather([list(out)], [x.contiguous()]))

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` into every rank's `x` (same shape and dtype), in place."""
        if self.tp_size == 1:
            return x
        self._broadcast(self._group(), x, src)
        return x

    def _broadcast(self, pg: dist.ProcessGroup, x: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait(pg.broadcast([x], opts), objects=pg is self.cpu_pg)

    def broadcast_object(self, obj: Any = None, src: int = 0, as_type: Any = Any) -> Any:
        """Rank `src`'s `obj` (anything msgspec's msgpack encodes: structs, dicts, lists, bytes)
        on every rank; the others pass None and get it decoded as `as_type` (msgspec's decode
        type, e.g. a Struct class; default: plain msgpack values). One broadcast over the CPU
        group when it fits the object buffer, two otherwise."""
        if self.tp_size == 1:
            return obj
        pg, buf = self._group(cpu=True), self._obj_buf
        room = buf.numel() - _HEADER
        if self.tp_rank == src:
            payload = msgspec.msgpack.encode(obj)
            n = len(payload)
            buf[:_HEADER] = torch.frombuffer(
                bytearray(n.to_bytes(_HEADER, "little")), dtype=torch.uint8
            )
            if n:
                buf[_HEADER : _HEADER + min(n, room)] = torch.frombuffer(
                    bytearray(payload[:room]), dtype=torch.uint8
                )
            self._broadcast(pg, buf, src)
            if n > room:
                self._broadcast(
                    pg, torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8), src
                )
            return obj
        self._broadcast(pg, buf, src)
        n = int.from_bytes(buf[:_HEADER].numpy().tobytes(), "little")
        data = buf[_HEADER : _HEADER + min(n, room)].numpy().tobytes()
        if n > room:
            rest = torch.empty(n - room, dtype=torch.uint8)
            self._broadcast(pg, rest, src)
            data += rest.numpy().tobytes()
        return msgspec.msgpack.decode(data, type=as_type)

    def rendezvous(self, timeout_s: float) -> None:
        """Every rank reaches this point, waiting up to `timeout_s` (not the group's timeout:
        for steps whose length differs between ranks, like compiling a graph). Over the
        store, so no process group's timeout applies; every rank calls it as often."""
        if self.tp_size == 1:
            return
        if self._destroyed or self._store is None:
            raise RuntimeError("TPGroup was destroyed")
        n, self._rendezvous_count = self._rendezvous_count, self._rendezvous_count + 1
        store = dist.PrefixStore(f"radixray-tp/rendezvous/{n}/", self._store)
        store.set(str(self.tp_rank), "1")
        store.wait([str(r) for r in range(self.tp_size)], timedelta(seconds=timeout_s))

    def barrier(self) -> None:
        """Every rank reaches this point (over the CPU group)."""
        if self.tp_size > 1:
            self._wait(self._group(cpu=True).barrier(), objects=True)

    def destroy(self) -> None:
        """Shut the process groups down and drop the store; later collectives raise. Idempotent."""
        if self._destroyed or self.tp_size == 1:
            self._destroyed = True
            return
        self._destroyed = True
        for pg in (self.pg, self.cpu_pg):
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):  # no shutdown() in this build: dropping it does
                pass
        self.pg = self.cpu_pg = self._store = None
