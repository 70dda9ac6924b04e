"""An attention-DP member's health check (actors/dp_coordinator.py) without Ray: the stall bound
comes from ClusterConfig.dp_stall_timeout_s, and a member whose check-ins all fail for longer
than it fails its health check."""

from __future__ import annotations

import pytest

from actors.dp_coordinator import DPMember
from cluster.config import ClusterConfig
from engine.errors import ConfigError


class FormedLoop:
    """Stands in for the member's engine.dp.DPLoop once its group has formed: never stalled."""

    def stalled_for(self) -> float:
        return 0.0


def test_a_member_cut_off_from_its_coordinator_fails_its_health_check():
    member = DPMember(engine=None, rank=1, size=2, coordinator=None, die=lambda e: None, stall_timeout_s=30.0)
    with pytest.raises(RuntimeError, match="still joining"):
        member.check()
    member.loop = FormedLoop()
    member.checked_in()
    member.check()
    member._checked_in_at -= 29.0  # failed check-ins, still within the bound
    member.check()
    member._checked_in_at -= 2.0
    with pytest.raises(RuntimeError, match="has not checked in with its coordinator for 31s"):
        member.check()
    member.checked_in()  # the coordinator answers again
    member.check()


def test_the_stall_bound_is_a_cluster_setting():
    assert ClusterConfig().dp_stall_timeout_s == 30.0
    assert ClusterConfig.from_kwargs(strict=False, dp_stall_timeout_s="5").dp_stall_timeout_s == 5.0
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="dp_stall_timeout_s"):
            ClusterConfig.from_kwargs(dp_stall_timeout_s=bad)
