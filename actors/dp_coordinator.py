"""DPCoordinator: membership, rendezvous and waves of one attention-DP group; DPMember: a
member's side of it.

The coordinator is not called on every step (members agree on token counts in-band); only when
an idle member gets work (`request_wave`), when a member (re)starts (`join`), and when a member
checks in (`attend`, every second). An epoch is (coordinator incarnation, number): one
formation of the group. A member that joins twice in one epoch was restarted: the coordinator
opens a new epoch and tells the others to leave the old one (gang restart), since their
collectives can no longer match. The order names the epoch it ends, so a message that arrives
late, after the member has restarted and joined the new epoch, is harmless.

The coordinator's state is soft. Restarted by Ray, it knows no epoch until a member checks in:
the first member's epoch is adopted, and every member that checks in with it is a member again
(its collectives never depended on the coordinator); the wave counter is raised to the highest
a member has seen, and each member is told it, so a wave announced to only part of the group
before the restart reaches the rest. A member that restarted meanwhile joins and starts a new
epoch as usual; members of any other epoch are told to leave."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import ray

Epoch = tuple[str, int]  # (coordinator incarnation, number)


class DPGroupStats(msgspec.Struct, kw_only=True):
    """One attention-DP group, as its coordinator sees it."""

    group: int
    epoch: int  # bumped on every gang restart (-1: none yet)
    waves_started: int
    members: list[int]  # ranks joined in this epoch
    restarts: int  # gang restarts this coordinator ordered
    coordinator: str = ""  # the coordinator's incarnation id (a new one after Ray restarted it)
    rejoins: int = 0  # members that checked back in after the coordinator restarted


class DPCoordinator:
    def __init__(self, group_id: int, size: int) -> None:
        self.group_id, self.size = group_id, size
        self.incarnation = uuid.uuid4().hex[:8]
        self.epoch: Epoch | None = None  # None: none yet (new, or restarted until a member checks in)
        self._next_number = 0
        self.joined: dict[int, Any] = {}  # rank -> actor handle, this epoch
        self.master: dict[Epoch, tuple[str, int]] = {}  # epoch -> (host, port) of rank 0's store
        self._master_set = asyncio.Event()
        self.wave = 0
        self.restarts = 0
        self.rejoins = 0  # members taken back after this coordinator restarted
        self._drop_waves = 0  # fault injection (tests): wave requests to lose

    def _new_epoch(self) -> Epoch:
        abandoned, others = self.epoch, list(self.joined.values())
        self.epoch = (self.incarnation, self._next_number)
        self._next_number += 1
        self.joined = {}
        self.wave = 0  # every member of the new epoch is a new process: its loop has run no wave
        self._master_set.set()  # wake waiters of the abandoned epoch (they will raise)
        self._master_set = asyncio.Event()
        if abandoned is not None:
            for h in others:  # not ray.kill: a late kill would hit a member of the new epoch
                h.leave_epoch.remote(abandoned)
        return self.epoch

    def join(self, rank: int, handle: Any) -> Epoch:
        """A member that (re)started. It restarts the group when this rank is already a member,
        or when the epoch is one adopted after a restart (the rank's old process may still be
        in it)."""
        if self.epoch is None:
            self._new_epoch()
        elif rank in self.joined or self.epoch[0] != self.incarnation:
            self.restarts += 1
            self._new_epoch()
        self.joined[rank] = handle
        return self.epoch

    def attend(self, rank: int, handle: Any, epoch: Epoch, signalled: int) -> bool:
        """A running member checks in: False tells it to leave (its epoch was abandoned)."""
        if self.epoch is None:  # restarted: the group the members formed goes on
            self.epoch = epoch
            self._next_number = epoch[1] + 1
        if epoch != self.epoch:
            return False
        if signalled > self.wave:
            self.wave = signalled
            for h in self.joined.values():
                h.signal_wave.remote(self.wave)
        if rank not in self.joined:
            self.joined[rank] = handle
            self.rejoins += 1
            handle.signal_wave.remote(self.wave)
        return True

    def set_master(self, epoch: Epoch, host: str, port: int) -> None:
        if epoch == self.epoch:
            self.master[epoch] = (host, port)
            self._master_set.set()

    async def get_master(self, epoch: Epoch) -> tuple[str, int]:
        while epoch not in self.master:
            if epoch != self.epoch:
                raise RuntimeError(f"DP group {self.group_id}: epoch {epoch} was abandoned")
            await asyncio.wait_for(self._master_set.wait(), timeout=300)
        return self.master[epoch]

    def request_wave(self) -> int:
        """An idle member got work: every member steps until all are empty again."""
        if self._drop_waves:
            self._drop_waves -= 1
            return self.wave
        self.wave += 1
        for h in self.joined.values():
            h.signal_wave.remote(self.wave)
        return self.wave

    def drop_wave_requests_for_tests(self, count: int) -> int:
        """Fault injection: lose the next `count` wave requests, as a restart would. Returns how
        many of the previous order were still to be lost."""
        left, self._drop_waves = self._drop_waves, count
        return left

    def stats(self) -> DPGroupStats:
        return DPGroupStats(group=self.group_id, epoch=self.epoch[1] if self.epoch else -1,
                            waves_started=self.wave, members=sorted(self.joined), restarts=self.restarts,
                            coordinator=self.incarnation, rejoins=self.rejoins)


class DPMember:
    """An engine actor's side of its group, on a thread of its own (the actor answers meanwhile,
    so `leave_epoch` reaches a member still waiting for its peers): join, rendezvous, start the
    lock-step loop (engine.dp.DPLoop), then check in with the coordinator every `check_period_s`.
    A member that had work and took no step for `stall_timeout_s` (no wave came, or a
    collective hangs) is stalled: it fails its health check and exits, so that it is replaced
    and its group restarts. A member whose check-ins have all failed for `stall_timeout_s` (its
    coordinator is gone and not back) fails its health check too (ClusterConfig.dp_stall_timeout_s)."""

    def __init__(self, engine: Any, rank: int, size: int, coordinator: Any, die: Callable[[BaseException], None],
                 timeout_s: float = 30.0, stall_timeout_s: float = 30.0, check_period_s: float = 1.0) -> None:
        self.engine, self.rank, self.size = engine, rank, size
        self.coordinator, self.die = coordinator, die
        self.timeout_s, self.stall_timeout_s, self.check_period_s = timeout_s, stall_timeout_s, check_period_s
        self.epoch: Epoch | None = None
        self.loop = None  # engine.dp.DPLoop, once the group has formed
        self._abandoned: set[Epoch] = set()  # leave orders that may overtake our join's answer
        self._checked_in_at = time.monotonic()  # the last check-in the coordinator answered (or the start)
        self._thread = threading.Thread(target=self._run, name="radixray-dp-member", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @staticmethod
    def _get(ref: Any, timeout_s: float | None = None) -> Any:
        # A future, not ray.get: the engine actor is async, where ray.get warns even off its loop.
        return ref.future().result(timeout=timeout_s)

    def _run(self) -> None:
        from engine.dp import DPComm, DPLoop
        from engine.tp.comm import make_store, serve_store

        me = ray.get_runtime_context().current_actor
        try:
            epoch = self._get(self.coordinator.join.remote(self.rank, me))
            self.epoch = epoch
            if epoch in self._abandoned:  # the group moved on while we joined
                raise RuntimeError(f"joined epoch {epoch}, which was abandoned meanwhile")
            if self.rank == 0:  # the store bound (on a port the OS picks) before anyone is told
                host = ray.util.get_node_ip_address()
                store, _ = serve_store(host, self.size, self.timeout_s)
                self._get(self.coordinator.set_master.remote(epoch, host, store.port))
            else:
                host, port = self._get(self.coordinator.get_master.remote(epoch))
                store = make_store(f"tcp://{host}:{port}", self.rank, self.size, self.timeout_s)
            comm = DPComm(store, self.rank, self.size, self.engine.model_runner.device, self.timeout_s)
            loop = DPLoop(self.engine, comm, lambda: self.coordinator.request_wave.remote(), self.die)
            self.engine.on_work = loop.wake
            loop.start()
            self.checked_in()  # the group formed through the coordinator: as good as a check-in
            self.loop = loop
        except BaseException as e:  # a peer vanished mid-rendezvous, an abandoned epoch: start over
            self.die(e)
            return
        while not self.engine.stopping:
            time.sleep(self.check_period_s)
            stalled = self.stalled_for()
            if stalled > self.stall_timeout_s:
                self.die(RuntimeError(f"DP member {self.rank} had work but took no step for {stalled:.0f}s"))
                return
            try:
                stay = self._get(self.coordinator.attend.remote(self.rank, me, epoch, loop.signalled),
                                 timeout_s=max(5.0, self.check_period_s))
            except Exception:  # the coordinator is restarting: check in again next period (check() bounds how long)
                continue
            if not stay:
                self.die(RuntimeError(f"DP epoch {epoch} was abandoned by the coordinator"))
                return
            self.checked_in()

    def leave_epoch(self, epoch: Epoch) -> None:
        """The coordinator abandoned `epoch` (a member restarted): leave it if it is ours."""
        self._abandoned.add(epoch)
        if self.epoch == epoch:
            self.die(RuntimeError(f"DP epoch {epoch} was replaced"))

    def signal_wave(self, wave: int) -> None:
        if self.loop is not None:
            self.loop.signal(wave)

    def stalled_for(self) -> float:
        return self.loop.stalled_for() if self.loop is not None else 0.0

    def checked_in(self) -> None:
        """The coordinator answered a check-in (or the group formed through it)."""
        self._checked_in_at = time.monotonic()

    def unchecked_for(self) -> float:
        """Seconds since the coordinator last answered this member."""
        return time.monotonic() - self._checked_in_at

    def check(self) -> None:
        """Raises while the group is unusable through this member: still forming, stalled, or
        cut off from its coordinator (no check-in answered) for longer than the stall bound."""
        if self.loop is None:
            raise RuntimeError(f"DP member {self.rank} is still joining its group")
        stalled = self.stalled_for()
        if stalled > self.stall_timeout_s:
            raise RuntimeError(f"DP member {self.rank} had work but took no step for {stalled:.0f}s")
        unchecked = self.unchecked_for()
        if unchecked > self.stall_timeout_s:
            raise RuntimeError(f"DP member {self.rank} has not checked in with its coordinator for {unchecked:.0f}s")
