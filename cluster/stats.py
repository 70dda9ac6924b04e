"""The cluster's stats: every engine's, the router's, and (attention-DP) every group's."""

from __future__ import annotations

import msgspec

from actors.stats import DPGroupStats, EngineActorStats
from cluster.routing import RoutingStats


class ClusterStats(msgspec.Struct, kw_only=True):
    engines: list[EngineActorStats]  # by engine id; an unreachable one has healthy=False and zeros
    routing: RoutingStats
    # Attention-DP: by group id (EngineActorStats.dp_group); empty without it, or when the
    # coordinators did not answer.
    dp_groups: list[DPGroupStats] = []
