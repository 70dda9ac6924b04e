"""Stats structs the actors return (pickled by Ray like any return value). DPGroupStats is
defined beside the DPCoordinator, whose process never imports the engine (nor torch)."""

from __future__ import annotations

import msgspec

from actors.dp_coordinator import DPGroupStats
from engine.engine import EngineStats

__all__ = ["DPGroupStats", "DPMemberStats", "EngineActorStats"]


class DPMemberStats(msgspec.Struct, kw_only=True):
    """One attention-DP member's lock-step loop."""

    rank: int
    waves: int  # waves this member has run
    steps: int  # group steps (forwards in lock-step) it took part in
    collective_seconds: float  # time spent in the group's collectives
    collective_bytes: int = 0  # bytes it sent in them (engine.dp.DPComm.collective_bytes)
    wave_requests: int = 0  # waves it asked the coordinator for, retries of lost requests included
    stalled_s: float = 0.0  # how long it has had work without taking a step (0: none, or stepping)


class EngineActorStats(msgspec.Struct, kw_only=True):
    """One engine actor: its engine's stats plus what only the actor (or the cluster) knows."""

    engine_id: int
    healthy: bool
    engine: EngineStats
    role: str = "null"  # prefill/decode disaggregation: "prefill", "decode"; "null": both
    dp: DPMemberStats | None = None  # attention-DP member only
    dp_group: int | None = None  # attention-DP: index of its group, set by the cluster
