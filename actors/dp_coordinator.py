"""DPCoordinator: membership, rendezvous and waves of one attention-DP group.

It is not called on every step (members agree on token counts in-band); only when an idle
member gets work (`request_wave`), and when a member (re)starts (`join`). A member that joins
twice in one epoch was restarted: the coordinator then opens a new epoch and tells the others
to leave older ones (gang restart), since their collectives can no longer match. The order
is conditional on the member's epoch, so a message that arrives late, after the member has
restarted and joined the new epoch, is harmless."""

from __future__ import annotations

import asyncio

from actors.stats import DPGroupStats


class DPCoordinator:
    def __init__(self, group_id: int, size: int) -> None:
        self.group_id, self.size = group_id, size
        self.epoch = 0
        self.joined: dict[int, object] = {}  # rank -> actor handle, this epoch
        self.master: dict[int, tuple[str, int]] = {}  # epoch -> (host, port) of rank 0's store
        self._master_set = asyncio.Event()
        self.wave = 0
        self.restarts = 0

    def join(self, rank: int, handle) -> int:
        if rank in self.joined:  # a restarted member: the whole group starts over
            self.epoch += 1
            self.restarts += 1
            others = [h for r, h in self.joined.items() if r != rank]
            self.joined = {}
            self._master_set.set()  # wake waiters of the abandoned epoch (they will raise)
            self._master_set = asyncio.Event()
            for h in others:  # not ray.kill: a late kill would hit a member of the new epoch
                h.leave_epochs_before.remote(self.epoch)
        self.joined[rank] = handle
        return self.epoch

    def set_master(self, epoch: int, host: str, port: int) -> None:
        if epoch == self.epoch:
            self.master[epoch] = (host, port)
            self._master_set.set()

    async def get_master(self, epoch: int) -> tuple[str, int]:
        while epoch not in self.master:
            if epoch != self.epoch:
                raise RuntimeError(f"DP group {self.group_id}: epoch {epoch} was abandoned")
            await asyncio.wait_for(self._master_set.wait(), timeout=300)
        return self.master[epoch]

    def request_wave(self) -> int:
        """An idle member got work: every member steps until all are empty again."""
        self.wave += 1
        for h in self.joined.values():
            h.signal_wave.remote(self.wave)
        return self.wave

    def stats(self) -> DPGroupStats:
        return DPGroupStats(group=self.group_id, epoch=self.epoch, waves_started=self.wave,
                            members=sorted(self.joined), restarts=self.restarts)
