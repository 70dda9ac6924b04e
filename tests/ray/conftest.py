"""Fixtures of the Ray tests: clusters that the tests of a module share, and single-engine
references.

A module lists its clusters in a `cluster_configs` fixture (key -> ClusterConfig) and a test
takes one by key:

    def test_x(clusters):
        cl = clusters.get("stories")

Tests that use one key in a row share that cluster. After each test the clusters it used must
settle (`settle`: healthy, every DP group re-formed, every engine's memory invariant), so a fault
test leaves its cluster restarted and the next test starts from a known state."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest

from cluster import Cluster, ClusterConfig
from engine import Engine


def settle(cl: Cluster, timeout_s: float = 120.0) -> None:
    """Until every engine is healthy (routable) and every attention-DP group has all its members
    (a group that restarted has re-formed); then every engine's memory invariant, which waits
    for its requests to end. AssertionError after timeout_s."""
    size = cl.config.dp_size
    deadline = time.monotonic() + timeout_s
    groups: list = []
    while True:
        with contextlib.suppress(Exception):  # a coordinator that Ray is restarting
            groups = cl.dp_stats()
            if all(cl.healthy()) and all(len(g.members) == size for g in groups):
                break
        assert time.monotonic() < deadline, ("cluster did not settle", cl.healthy(), groups)
        time.sleep(0.1)
    cl.check_memory()


def take_down_engine_0(cl: Cluster, timeout_s: float = 30.0) -> None:
    """Kill engine 0's actor (Ray restarts it) and wait until the cluster routes around it."""
    import ray

    ray.kill(cl.actors[0], no_restart=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and cl.healthy()[0]:
        time.sleep(0.1)


class SharedClusters:
    """The clusters of a module's `cluster_configs` (key -> ClusterConfig), each started on first
    use and kept for the tests after it while at most `max_engines` engines are up (the least
    recently used cluster is shut down first; the session's Ray has 4 CPUs, one per engine).
    The clusters a test used are settled after it; one that does not settle (the test left it
    broken) is shut down, so the next test gets a new one and the failure stays that test's."""

    def __init__(self, configs: dict[str, ClusterConfig], max_engines: int = 4) -> None:
        self.configs, self.max_engines = configs, max_engines
        self.live: dict[str, Cluster] = {}  # least recently used first
        self.used: list[str] = []  # by the running test

    def get(self, key: str) -> Cluster:
        cl = self.live.pop(key, None)
        if cl is None:
            need = self.configs[key].num_engines
            while self.live and sum(c.config.num_engines for c in self.live.values()) + need > self.max_engines:
                self.close(next(iter(self.live)))
            cl = Cluster(self.configs[key])  # returns once every engine (and DP group) is ready
        self.live[key] = cl
        self.used.append(key)
        return cl

    def settle_used(self) -> None:
        used, self.used = self.used, []
        for key in dict.fromkeys(k for k in used if k in self.live):
            try:
                settle(self.live[key])
            except BaseException:
                self.close(key)
                raise

    def close(self, key: str) -> None:
        self.live.pop(key).shutdown()

    def close_all(self) -> None:
        while self.live:
            self.close(next(iter(self.live)))


@pytest.fixture(scope="module")
def shared_clusters(ray_local, cluster_configs: dict[str, ClusterConfig]) -> Iterator[SharedClusters]:
    shared = SharedClusters(cluster_configs)
    yield shared
    shared.close_all()


@pytest.fixture
def clusters(shared_clusters: SharedClusters) -> Iterator[SharedClusters]:
    """The module's shared clusters (`clusters.get(key)`); those the test used are settled after
    it (a failure to settle is the test's error, at its teardown)."""
    yield shared_clusters
    shared_clusters.settle_used()


@pytest.fixture(scope="module")
def single() -> Callable[[str], Engine]:
    """model path -> one in-process Engine with the default config (the references), built once
    per module."""
    engines: dict[str, Engine] = {}

    def get(path: str) -> Engine:
        if path not in engines:
            engines[path] = Engine(model_path=path)
        return engines[path]
    return get
