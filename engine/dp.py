"""Attention-DP: a group of engines runs attention data-parallel (each its own requests, cache
and KV) and splits every MLP over the group, so the group steps in lock-step.

`DPComm` owns the group's collectives (gloo on CPU, NCCL on CUDA) on a private process group:
no torch.distributed default group, so nothing process-global. `DPLoop` replaces the engine's
background loop: it sleeps until a *wave* is signalled, then steps with the others until every
member reports no work; a member with nothing to run joins each step with an IDLE batch.
No Ray here: waves are requested and signalled through callables the actor layer provides."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.engine import Engine
from engine.req import Req
from engine.schedule_batch import ScheduleBatch
from engine.scheduler import Scheduler, StepStrategy
from kernels.lora import LoRABatchInfo, batch_info


class DPComm:
    """Member `rank` of a `world`-member group over the rendezvous `store` (rank 0 serves it:
    engine.tp.comm.serve_store; the others join it: make_store)."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device,
                 timeout_s: float = 30.0) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.store = store
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank, self.world, self.device = rank, world, device
        self.counts: list[int] = [0] * world  # every member's token count in the current step
        self.collective_seconds = 0.0
        # Bytes this member put on the wire for the collectives, as the usual algorithms move them:
        # an all-gather sends its buffer to each peer, a ring all-reduce 2(G-1)/G of its buffer,
        # an all-to-all the rows meant for others.
        self.collective_bytes = 0
        # Expert parallelism: send each token to its experts' members (all-to-all) instead of
        # gathering every member's rows and reducing the partial outputs (EngineConfig.moe_dispatch).
        self.moe_all_to_all = False

    def _wait(self, work, sent_bytes: int) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.collective_seconds += time.perf_counter() - t0
        self.collective_bytes += sent_bytes

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        outs = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(self.pg.allgather([outs], [t]), _nbytes(t) * (self.world - 1))
        return [o.tolist() for o in outs]

    # ---- the model's mlp_comm hooks ------------------------------------------------------
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T_local, H] -> every member's tokens [sum T, H], in rank order (padded exchange)."""
        longest = max(self.counts)
        padded = x.new_zeros((longest, x.shape[1]))
        padded[:x.shape[0]] = x
        outs = [torch.empty_like(padded) for _ in range(self.world)]
        self._wait(self.pg.allgather([outs], [padded]), _nbytes(padded) * (self.world - 1))
        return torch.cat([o[:n] for o, n in zip(outs, self.counts)])

    def gather_lora(self, info: LoRABatchInfo | None, rows: int) -> LoRABatchInfo | None:
        """The adapter segments of every member's rows, in `gather`'s order: what an MLP split over
        the group adapts its gathered rows by (each member holds every adapter in the same slot).
        `info`: this member's `rows` rows (None: none adapted). None when no member's row is."""
        slots = torch.full((rows, 1), -1, dtype=torch.int32)
        if info is not None:
            for lo, hi, slot in zip(info.seg_indptr_host, info.seg_indptr_host[1:], info.weight_indices_host):
                slots[lo:hi] = slot
        every = self.gather(slots.to(self.device)).view(-1).cpu()
        if every.numel() == 0 or int(every.max()) < 0:
            return None
        # One segment per run of equal slots (found in torch: a prefill gathers many rows).
        starts = torch.cat([every.new_zeros(1, dtype=torch.long),
                            torch.nonzero(every[1:] != every[:-1]).view(-1) + 1])
        lengths = torch.diff(starts, append=torch.tensor([every.numel()]))
        return batch_info(every[starts].tolist(), lengths.tolist(), self.device)

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        """Partial MLP outputs over all tokens -> the summed rows of this member's tokens.
        (An all-reduce then a slice: gloo has no reduce-scatter.)"""
        y = y.contiguous()
        self._wait(self.pg.allreduce([y]), 2 * (self.world - 1) * _nbytes(y) // self.world)
        start = sum(self.counts[:self.rank])
        return y[start:start + self.counts[self.rank]]

    def exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """All-to-all: rows of x grouped by destination (send[d] rows for member d, in rank order)
        -> the rows the members sent here, grouped by source (recv[s] from member s)."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        row = x[:1].numel() * x.element_size()
        self._wait(self.pg.alltoall_base(out, x.contiguous(), recv, send), (sum(send) - send[self.rank]) * row)
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DPLockStep(StepStrategy):
    """The step strategy of a group member: after scheduling, the group agrees on every member's
    token count; a member with nothing to run joins the forward with an IDLE batch (its MLP
    collectives need every member), and the wave ends when no member has work."""

    def __init__(self, comm: DPComm, has_pending: Callable[[], bool]) -> None:
        self.comm = comm
        self.has_pending = has_pending
        self.wave_on = False

    def sync(self, sched: Scheduler, batch: ScheduleBatch | None, touched: list[Req]) -> ScheduleBatch | None:
        local = batch.input_ids.shape[0] if batch is not None else 0
        counts = self.comm.all_gather_ints([local, int(self.has_pending() or bool(touched))])
        self.wave_on = any(n or busy for n, busy in counts)
        self.comm.counts = [n for n, _ in counts]
        if sum(self.comm.counts) == 0:  # no member has tokens (work may wait for KV): no forward
            if self.wave_on:
                time.sleep(0.001)
            return None
        return batch if batch is not None else sched.idle_batch()

    def again(self, sched: Scheduler) -> bool:
        return self.wave_on


class DPLoop:
    """The engine loop of one attention-DP member: waves of lock-steps.

    A wave request may be lost (the coordinator restarted before it answered): a member that
    has work and no wave asks again every `wave_retry_s`. An extra wave is harmless (every
    member runs every wave: one step in which nobody has work ends it)."""

    def __init__(self, engine: Engine, comm: DPComm, request_wave: Callable[[], None],
                 on_fatal: Callable[[BaseException], None], wave_retry_s: float = 1.0) -> None:
        self.engine, self.comm = engine, comm
        self.request_wave = request_wave
        self.on_fatal = on_fatal
        self.wave_retry_s = wave_retry_s
        engine.model_runner.model.mlp_comm = comm
        comm.moe_all_to_all = engine.config.moe_dispatch == "all_to_all"
        engine.scheduler.isolate_batch_failures = False
        engine.strategy = DPLockStep(comm, engine.has_pending)
        self._cv = threading.Condition()
        self.signalled = 0  # waves the coordinator announced
        self.waves = 0  # waves this member has run
        self.steps = 0
        self.wave_requests = 0  # requests sent, retries included
        self._asked_at: float | None = None  # when this member last asked for the wave it waits for
        # When the member last made progress: a step done, or seen with nothing to do.
        self._progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="radixray-dp-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def signal(self, wave: int) -> None:
        with self._cv:
            self.signalled = max(self.signalled, wave)
            self._cv.notify()

    def wake(self) -> None:
        """New local work: the loop asks for a wave if it is sleeping."""
        with self._cv:
            self._cv.notify()

    def stalled_for(self) -> float:
        """Seconds this member has had work without taking a step (0 when it has none): no wave
        came, or a collective does not return."""
        if not self.engine.has_pending():
            return 0.0
        return max(0.0, time.monotonic() - self._progress)

    def _run(self) -> None:
        try:
            while not self.engine.stopping:
                with self._cv:
                    while self.waves >= self.signalled and not self.engine.stopping:
                        if not self.engine.has_pending():
                            self._progress = time.monotonic()
                            self._asked_at = None
                        elif self._asked_at is None or time.monotonic() - self._asked_at >= self.wave_retry_s:
                            self._asked_at = time.monotonic()
                            self.wave_requests += 1
                            self.request_wave()
                        self._cv.wait(timeout=min(0.5, self.wave_retry_s))
                    self._asked_at = None
                if self.engine.stopping:
                    return
                while self.engine.step():  # one wave: lock-steps until no member has work
                    self.steps += 1
                    self._progress = time.monotonic()
                self.steps += 1
                self.waves += 1
                self._progress = time.monotonic()
        except BaseException as e:  # a dead peer (collective timeout) or a bug: fail loudly
            self.engine.dead = e
            self.on_fatal(e)
