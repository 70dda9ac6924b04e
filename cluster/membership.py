"""Which engines a Cluster routes to: the ones it starts and owns (actors in a placement group,
with their attention-DP coordinators), or a Serve fleet's, followed as engines join, drain and
leave (deploy/engines.py). Each engine gets an index that is never reused."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.dp_coordinator import DPCoordinator
from actors.engine_actor import EngineActor
from actors.protocol import EngineInfo
from cluster.config import ClusterConfig
from cluster.health import wait_ready

log = logging.getLogger("radixray.cluster")
ACTOR_NAMESPACE = "radixray"
FLEET_GRACE_S = 15.0  # how long a replaced registry may not list a live engine (lease renewals)


def ensure_ray(address: str | None = None, log_to_driver: bool = False) -> bool:
    """Connect to Ray (address, RAY_ADDRESS) or start a local one. Returns whether we started it.
    log_to_driver: the actors' stderr (errors, engine tracebacks) is printed by this process."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return False
    # "local": always a new private cluster, never one found through /tmp/ray by accident.
    ray.init(address="local", include_dashboard=False, log_to_driver=log_to_driver)
    return True


@dataclass
class EngineSlot:
    """One engine the cluster routes to (index = its position in Cluster.engines)."""

    actor: Any
    info: EngineInfo
    name: str
    consumers: list = field(default_factory=list)  # its output and KV event readers
    first_beat: Any = None  # a heartbeat sent when it was added: where its evictions start for us
    retired: bool = False  # left the fleet: never routed to again


def make_dp_groups(cfg: ClusterConfig) -> tuple[list, list[dict | None]]:
    """Attention-DP: one DPCoordinator per group of dp_size consecutive engines of cfg.dp_span
    (a disaggregated cluster's decode engines; its prefill engines run alone)."""
    members: list[dict | None] = [None] * cfg.num_engines
    if not cfg.enable_dp_attention:
        return [], members
    first, count = cfg.dp_span
    size = cfg.dp_size
    coord_cls = ray.remote(DPCoordinator)
    coords = [coord_cls.options(num_cpus=0, max_restarts=-1).remote(g, size) for g in range(count // size)]
    for i in range(count):
        members[first + i] = {"rank": i % size, "size": size, "coordinator": coords[i // size],
                              "stall_timeout_s": cfg.dp_stall_timeout_s}
    return coords, members


@dataclass
class OwnedEngines:
    """The engine actors, DP coordinators and placement group a Cluster started itself. Filled
    as they start, so stop() also takes down what a failed start got to."""

    pg: Any = None
    tp_pgs: list = field(default_factory=list)  # tp_size > 1: one placement group per engine
    actors: list = field(default_factory=list)
    coordinators: list = field(default_factory=list)
    device: str = "cpu"
    cluster_id: str = ""

    def start(self, cfg: ClusterConfig) -> list[tuple[Any, EngineInfo, str]]:
        """Start cfg.num_engines engines; (actor, info, name) of each once all are ready."""
        use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        self.device = "cuda" if use_gpu else "cpu"
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": cfg.cpus_per_rank}
        tp = None
        if cfg.tp_size > 1:  # each engine a gang: its ranks' bundles in a group of their own
            self.tp_pgs = [placement_group([bundle] * cfg.tp_size, strategy=cfg.tp_placement_strategy)
                           for _ in range(cfg.num_engines)]
            ray.get([pg.ready() for pg in self.tp_pgs], timeout=120)
            tp = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "bundles": list(range(1, cfg.tp_size))}
        else:
            self.pg = placement_group([bundle] * cfg.num_engines, strategy=cfg.placement_strategy)
            ray.get(self.pg.ready(), timeout=120)
        roles = [cfg.engine_role(i) for i in range(cfg.num_engines)]
        engine_cfgs = {role: msgspec.structs.asdict(cfg.engine_config(self.device, role)) for role in set(roles)}
        actor_cls = ray.remote(EngineActor)
        # Named (in namespace "radixray") so operators, tests and decode engines (their prefill
        # engines) can find a cluster's engines.
        self.cluster_id = uuid.uuid4().hex[:8]
        names = [f"radixray-{self.cluster_id}-engine-{i}" for i in range(cfg.num_engines)]
        peers = {"names": [n for n, r in zip(names, roles) if r == "prefill"], "namespace": ACTOR_NAMESPACE}
        self.coordinators, dp = make_dp_groups(cfg)
        for i in range(cfg.num_engines):  # one at a time: a failure leaves self.actors complete
            self.actors.append(actor_cls.options(
                name=names[i], namespace=ACTOR_NAMESPACE, lifetime=None,
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=cfg.max_restarts,
                max_task_retries=0, max_concurrency=10_000,
                scheduling_strategy=(PlacementGroupSchedulingStrategy(self.tp_pgs[i], placement_group_bundle_index=0)
                                     if tp else PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)),
            ).remote(engine_cfgs[roles[i]], i, dp[i], peers if roles[i] == "decode" else None, tp))
        infos = ray.get([a.info.remote() for a in self.actors], timeout=600)
        wait_ready(self.actors, timeout_s=600)  # attention-DP members: once their group formed
        return list(zip(self.actors, infos, names))

    def stop(self) -> None:
        for a in self.actors + self.coordinators:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        for pg in [self.pg, *self.tp_pgs]:
            if pg is not None:
                remove_placement_group(pg)


class FleetWatcher:
    """Applies a Serve fleet's member list to a Cluster whenever it changes (a long poll on the
    fleet's registry): a new engine is added, a draining one takes no new request, one that left
    is retired. Runs on its own thread."""

    def __init__(self, fleet: Any, lock: threading.Lock, add: Callable[[Any, EngineInfo, str], int],
                 drain: Callable[[int], None], retire: Callable[[int], None], closed: threading.Event) -> None:
        """add(actor, info, name) -> its index and drain(index) are called holding `lock`;
        retire(index) takes it itself."""
        self.fleet = fleet
        self.lock = lock
        self.add = add
        self.drain = drain
        self.retire = retire
        self.closed = closed
        self.keys: dict[str, int] = {}  # the fleet's key of each engine in it -> its index

    def run(self, first: threading.Event) -> None:
        """Until the cluster closes; sets `first` once an engine has joined."""
        version = None
        missing: dict[str, tuple[str, float]] = {}  # key -> (registry instance, time) first missed
        known_registry: dict[str, str] = {}  # key -> the registry instance that last listed it
        while not self.closed.is_set():
            try:
                version, members = self.fleet.watch.remote(version).result(timeout_s=60)
            except Exception as e:  # the registry is restarting
                if self.closed.is_set():
                    return
                log.warning("fleet watch failed: %s", type(e).__name__)
                time.sleep(1.0)
                continue
            seen = set()
            for key, engine_id, actor, info, state in members:
                seen.add(key)
                with self.lock:
                    idx = self.keys.get(key)
                    if idx is None:
                        info = msgspec.msgpack.decode(info, type=EngineInfo)
                        idx = self.keys[key] = self.add(actor, info, info.actor_name or key)
                        log.info("engine %d joined (index %d)", engine_id, idx)
                    if state == "draining":
                        self.drain(idx)
            # An engine missing from the list has left, unless the registry itself was replaced:
            # its engines register again within a lease renewal, so only a longer absence counts.
            now = time.monotonic()
            registry = version[0]
            for key in [k for k in self.keys if k not in seen]:
                since = missing.setdefault(key, (registry, now))
                if since[0] == known_registry.get(key, registry) or now - since[1] > FLEET_GRACE_S:
                    missing.pop(key)
                    self.retire(self.keys.pop(key))
            for key in seen:
                missing.pop(key, None)
                known_registry[key] = registry
            if self.keys:
                first.set()
