"""The engines as a Ray Serve deployment, and the fleet registry the front ends watch.

One `EngineServer` replica = one engine: the replica holds a Serve-managed placement-group bundle
(one GPU, or a CPU share) and runs the engine as a child actor in it, so Serve's health checks,
autoscaling and rolling updates act on engines, and an engine dies with its replica. The front
ends talk to the engines directly (one multiplexed output stream per engine and front end, KV
event streams, aborts), not through Serve's per-request handle path: that path costs one Ray
object per streamed chunk per request, and routing needs the engines' KV events, which a Serve
request router cannot subscribe to. They find the engines through the `Fleet` deployment:
engines register and renew a lease; front ends long-poll the member list.

An attention-DP group is a Serve gang (`gang_scheduling_config`): its G replicas are placed in
one placement group, scaled by whole gangs and restarted as a unit (RESTART_GANG), and the
members find their DPCoordinator by the gang's id."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import ray
from ray import serve
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.dp_coordinator import DPCoordinator
from actors.engine_actor import EngineActor
from actors.protocol import EngineInfo, GenerateRequest, encode
from cluster.cluster import ACTOR_NAMESPACE
from deploy.options import AppArgs, FleetOptions
from engine import SamplingParams
from engine.logs import log_to_stderr

log = logging.getLogger("radixray.engines")
LEASE_S = 10.0  # an engine that has not renewed its lease for this long has left the fleet
RENEW_PERIOD_S = 1.0
# A stopping engine's calls to the registry: a live one answers at once; when the whole app is
# deleted it is gone, and each call waits this long (the lease would expire anyway).
REGISTRY_CALL_S = 1.0


class GenerateCall(msgspec.Struct, frozen=True):
    """One request on Serve's handle path (EngineServer.generate: one stream per request). The
    front ends do not use it; it is how Serve's own request routers reach the engines, e.g.
    PrefixCacheAffinityRouter, which matches prefixes on `prompt`."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    prompt: str = ""
    lora_name: str | None = None  # its LoRA adapter (None: the base model)


@dataclass
class _Member:
    engine_id: int
    actor: Any = None  # None while the engine starts
    info: bytes = b""
    state: str = "starting"  # starting, ready, draining
    expires: float = 0.0


class FleetEvents(msgspec.Struct, kw_only=True):
    registered: int = 0
    drains: int = 0
    left: int = 0  # deregistered after a drain or a clean stop
    expired: int = 0  # lease ran out: the engine died without deregistering


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000, health_check_period_s=2.0,
                  logging_config={"enable_access_log": False})
class Fleet:
    """Membership of the engine fleet: soft state, rebuilt by the engines' lease renewals if this
    replica is replaced. Front ends call watch() in a loop and apply the full member list."""

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex[:8]
        self.members: dict[str, _Member] = {}
        self.version = 0
        self.changed = asyncio.Event()
        self.next_id = 0
        self.events = FleetEvents()

    def _bump(self) -> None:
        self.version += 1
        self.changed.set()
        self.changed = asyncio.Event()

    def _expire(self) -> None:
        now = time.monotonic()
        gone = [k for k, m in self.members.items() if m.expires < now]
        for key in gone:
            del self.members[key]
            self.events.expired += 1
        if gone:
            self._bump()

    async def register(self, key: str, engine_id: int | None = None) -> int:
        """A starting engine's id (stable for its life; not reused). An engine that registers
        again with a replaced registry keeps its id."""
        if key not in self.members:
            if engine_id is None:
                engine_id = self.next_id
            self.next_id = max(self.next_id, engine_id + 1)
            self.members[key] = _Member(engine_id, expires=time.monotonic() + LEASE_S)
            self.events.registered += 1
        return self.members[key].engine_id

    async def renew(self, key: str, actor: Any = None, info: bytes = b"", state: str | None = None) -> bool:
        """Extend the lease; the first renewal with an actor makes the engine routable. False:
        unknown key (this registry was replaced), the engine registers again."""
        self._expire()
        m = self.members.get(key)
        if m is None:
            return False
        m.expires = time.monotonic() + LEASE_S
        if actor is not None and m.actor is None:
            m.actor, m.info, m.state = actor, info, "ready"
            self._bump()
        if state == "draining" and m.state != "draining":
            m.state = "draining"
            self.events.drains += 1
            self._bump()
        return True

    async def leave(self, key: str) -> None:
        if self.members.pop(key, None) is not None:
            self.events.left += 1
            self._bump()

    async def watch(self, version: tuple[str, int] | None, timeout_s: float = 5.0
                    ) -> tuple[tuple[str, int], list[tuple[str, int, Any, bytes, str]]]:
        """The member list (key, engine_id, actor, info, state) once it differs from `version`,
        or after timeout_s."""
        if version == (self.instance, self.version):
            changed = self.changed
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        self._expire()
        members = [(k, m.engine_id, m.actor, m.info, m.state) for k, m in self.members.items()
                   if m.actor is not None]
        return (self.instance, self.version), members

    async def stats(self) -> FleetEvents:
        self._expire()
        return self.events


def _engine_bundle(cluster: Any) -> dict[str, float]:
    """One engine's resources: a GPU, or a CPU share (auto: a GPU when the Ray cluster has them;
    an app built with no Ray running, as `serve build` does, gets the CPU shape)."""
    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    use_gpu = cluster.device == "cuda" or (cluster.device == "auto" and gpus >= 1)
    return {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": cluster.cpus_per_engine / cluster.tp_size}


class EngineServer:
    """One engine of the fleet (see the module docstring). Deployed by engine_deployment()."""

    @staticmethod
    def _tp_ranks(cfg: Any, bundle: dict[str, float]) -> dict | None:
        """tp_size > 1: the engine's other ranks, in the replica's bundles 1..N-1 (EngineActor's tp)."""
        if cfg.tp_size == 1:
            return None
        return {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "bundles": list(range(1, cfg.tp_size))}

    async def __init__(self, args: dict[str, Any], fleet: Any, prefill: Any = None) -> None:  # async: Serve awaits it
        """prefill: a decode engine's prefill deployment (bound so that Serve deploys it with this
        one, as Ray Serve LLM's decode server holds its prefill server); the engines themselves
        find each other through the fleet registry."""
        log_to_stderr()
        app_args = AppArgs.from_dict(args)
        cfg, self.options = app_args.cluster, app_args.fleet
        self.fleet = fleet
        ctx = serve.get_replica_context()
        self.key = ctx.replica_id.unique_id
        self.engine_id = await fleet.register.remote(self.key)
        bundle = _engine_bundle(cfg)
        device = "cuda" if "GPU" in bundle else "cpu"
        gang = ctx.gang_context
        dp = None
        if cfg.enable_dp_attention:
            # Restartable: its state is soft (the members check back in and their group goes
            # on); it lives as long as the replica that created it, whose death restarts the gang.
            coordinator = ray.remote(DPCoordinator).options(
                name=f"radixray-dp-{gang.gang_id}", namespace=ACTOR_NAMESPACE, get_if_exists=True,
                num_cpus=0, max_restarts=-1).remote(0, gang.world_size)
            dp = {"rank": gang.rank, "size": gang.world_size, "coordinator": coordinator,
                  "stall_timeout_s": cfg.dp_stall_timeout_s}
        pg = ray.util.get_current_placement_group()
        strategy = None
        if pg is not None:  # the replica's own bundle (bundle `rank` of its gang's group)
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=gang.rank if gang else 0)
        engine_config = cfg.engine_config(device)
        self.role = engine_config.disaggregation_mode
        # A decode engine learns its prefill engines from the fleet (_follow_prefill_engines).
        peers = {"names": [], "namespace": ACTOR_NAMESPACE} if self.role == "decode" else None
        # max_restarts=0: a dead engine fails this replica's health check and Serve replaces
        # the replica (under attention-DP, the whole gang).
        self.engine = ray.remote(EngineActor).options(
            name=f"radixray-{ctx.app_name}-engine-{self.key}", namespace=ACTOR_NAMESPACE,
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_task_retries=0,
            max_concurrency=10_000, scheduling_strategy=strategy,
        ).remote(msgspec.structs.asdict(engine_config), self.engine_id, dp, peers, self._tp_ranks(cfg, bundle))
        info: EngineInfo = await self.engine.info.remote()
        deadline = time.monotonic() + 600
        # Attention-DP members are ready once their group has formed (until then ready() is
        # False: an expected state, not an error); a dead or stalled engine raises.
        while not await self.engine.ready.remote():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id}: its DP group did not form in 600s")
            await asyncio.sleep(0.2)
        self.info = encode(info)
        if self.role == "decode":
            await self._take_prefill_engines()
        self._state: str | None = None
        self._stop = threading.Event()
        if not await fleet.renew.remote(self.key, self.engine, self.info):  # a long start outlived the lease
            await fleet.register.remote(self.key, self.engine_id)
            await fleet.renew.remote(self.key, self.engine, self.info)
        threading.Thread(target=self._renew_lease, name="radixray-lease", daemon=True).start()
        if self.role == "decode":
            threading.Thread(target=self._follow_prefill_engines, name="radixray-prefill-peers", daemon=True).start()

    async def _take_prefill_engines(self) -> None:
        """A decode engine's first prefill engines, before it becomes routable (one read of the
        fleet; _follow_prefill_engines keeps them current)."""
        _, members = await self.fleet.watch.remote(None)
        await self.engine.set_prefill_peers.remote(prefill_engine_names(members))

    def _follow_prefill_engines(self) -> None:
        """A decode engine's prefill engines: the fleet's, by actor name, whenever they change."""
        version, names = None, None
        while not self._stop.is_set():
            try:
                version, members = self.fleet.watch.remote(version).result(timeout_s=60)
            except Exception as e:  # the registry is restarting
                log.warning("engine %d could not read the fleet: %s", self.engine_id, type(e).__name__)
                self._stop.wait(1.0)
                continue
            now = prefill_engine_names(members)
            if now != names:
                try:
                    self.engine.set_prefill_peers.remote(now).result(timeout_s=10)
                    names = now
                except Exception as e:  # the engine is gone (this replica is being replaced)
                    log.warning("engine %d could not take its prefill engines: %s", self.engine_id, type(e).__name__)

    def _renew_lease(self) -> None:
        while not self._stop.wait(RENEW_PERIOD_S):
            try:
                known = self.fleet.renew.remote(self.key, state=self._state).result(timeout_s=10)
                if not known and not self._stop.is_set():  # the registry was replaced (or forgot us): register again
                    self.fleet.register.remote(self.key, self.engine_id).result(timeout_s=10)
                    self.fleet.renew.remote(self.key, self.engine, self.info, self._state).result(timeout_s=10)
            except Exception as e:  # the registry is restarting: the lease outlives a few misses
                log.warning("engine %d could not renew its lease: %s", self.engine_id, type(e).__name__)

    async def generate(self, call: GenerateCall):
        """Serve's handle path: the request's msgpack-encoded StreamDeltas, one item per step."""
        payload = encode(GenerateRequest(rid=call.rid, input_ids=call.input_ids,
                                         sampling_params=call.sampling_params, lora_name=call.lora_name))
        finished = False
        try:
            async for ref in self.engine.generate.remote(payload):
                item = await ref
                yield item
            finished = True
        finally:
            if not finished:  # the caller went away: free the request's KV on the engine
                self.engine.abort.remote(call.rid)

    async def check_health(self) -> None:
        await self.engine.check_health.remote()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The autoscaling signals of this engine (see EngineAutoscaler)."""
        s = (await self.engine.stats.remote()).engine
        # A decode engine's requests waiting for KV memory or for their KV are waiting too.
        return {"waiting": float(s.waiting + s.prealloc_queue), "running": float(s.running),
                "waiting_tokens": float(s.waiting_prompt_tokens),
                "kv_use": s.kv_used / s.kv_total if s.kv_total else 0.0}

    async def stats(self) -> bytes:
        return encode(await self.engine.stats.remote())

    async def __del__(self) -> None:
        """Scale-down or rolling update: drain, then leave the fleet and stop the engine."""
        if getattr(self, "engine", None) is None:
            return
        self._state = "draining"
        try:
            # Bounded: when the whole app is deleted the registry may be gone already (a live one
            # answers in milliseconds).
            await asyncio.wait_for(self.fleet.renew.remote(self.key, state="draining"), timeout=REGISTRY_CALL_S)
        except Exception as e:  # the lease thread sends the state again
            log.warning("engine %d could not announce its drain: %s", self.engine_id, type(e).__name__)
        try:
            left = await self.engine.drain.remote(self.options.drain_reroute_after_s, self.options.drain_timeout_s)
            if left:
                log.warning("engine %d stopped with %d request(s) still running", self.engine_id, left)
        except Exception as e:  # the engine is already gone
            log.warning("engine %d drain failed: %s", self.engine_id, type(e).__name__)
        self._stop.set()
        try:
            await asyncio.wait_for(self.fleet.leave.remote(self.key), timeout=REGISTRY_CALL_S)
        except Exception as e:  # the registry is gone too (the app is being deleted): the lease expires
            log.warning("engine %d could not leave the fleet: %s", self.engine_id, type(e).__name__)
        finally:
            ray.kill(self.engine, no_restart=True)


def prefill_engine_names(members: list) -> list[str]:
    """The actor names of the prefill engines in a fleet member list (draining ones left out)."""
    infos = [msgspec.msgpack.decode(info, type=EngineInfo) for _, _, _, info, state in members if state != "draining"]
    return sorted(i.actor_name for i in infos if i.disaggregation_mode == "prefill")


class EngineAutoscaler:
    """Serve autoscaling policy on LLM signals: scale up while engines queue requests or fill
    their KV pools past the targets; scale down when a smaller fleet would still be under them.
    Whole DP groups at a time (gang_size). Serve applies the up/down delays."""

    def __init__(self, target_waiting_per_engine: float = 2.0, target_kv_use: float = 0.85,
                 gang_size: int = 1, waiting_metric: str = "waiting") -> None:
        """waiting_metric: what waits, "waiting" (requests) or "waiting_tokens" (prompt tokens: a
        prefill pool's load)."""
        self.target_waiting = target_waiting_per_engine
        self.target_kv = target_kv_use
        self.gang = gang_size
        self.metric = waiting_metric

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        n = ctx.current_num_replicas
        metrics = ctx.aggregated_metrics or {}
        if n == 0 or self.metric not in metrics:
            return ctx.target_num_replicas, {}
        waiting = sum(metrics.get(self.metric, {}).values())
        running = sum(metrics.get("running", {}).values())
        kv = metrics.get("kv_use", {})
        kv_mean = sum(kv.values()) / max(len(kv), 1)
        # Engines the load needs: queued requests at the target depth, KV use at its target.
        need = max(waiting / self.target_waiting, n * kv_mean / self.target_kv)
        if waiting > self.target_waiting * n or kv_mean > self.target_kv:
            desired = max(n + self.gang, math.ceil(need))
        elif waiting == 0 and running == 0 and kv_mean == 0:
            desired = n - self.gang  # idle: shrink one group at a time (Serve keeps min_replicas)
        else:
            desired = max(math.ceil(need), n - self.gang) if need < n - self.gang else n
        desired = self.gang * math.ceil(desired / self.gang)
        return max(ctx.capacity_adjusted_min_replicas, min(desired, ctx.capacity_adjusted_max_replicas)), {}


def frontend_options(options: FleetOptions) -> dict[str, Any]:
    """The front-end deployment's replica count: fixed, or autoscaled on ongoing requests."""
    if options.max_frontends is None:
        return {"num_replicas": options.frontends}
    return {"autoscaling_config": {"min_replicas": options.frontends, "max_replicas": options.max_frontends,
                                   "target_ongoing_requests": options.target_requests_per_frontend}}


def gang_size(cluster: Any) -> int:
    """Engines per unit of placement and scaling: an attention-DP group, else one."""
    return (cluster.dp_group_size or cluster.num_engines) if cluster.enable_dp_attention else 1


def engine_deployment(cluster: Any, options: FleetOptions, role: str = "null") -> serve.Deployment:
    """The EngineServer deployment for this shape: replicas, bundles, gangs and autoscaling.
    role: a disaggregated fleet's pool ("prefill", "decode"), each a deployment of its own."""
    gang = gang_size(cluster)
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": 0},
        "placement_group_bundles": [_engine_bundle(cluster)] * cluster.tp_size,  # tp_size > 1: a rank each
        "max_ongoing_requests": 1000,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": options.drain_timeout_s + 15.0,
        "logging_config": {"enable_access_log": False},
        # A rolling update (a config change) replaces one replica (one engine) at a time, each
        # after its drain; under attention-DP Serve replaces whole gangs.
        "rolling_update_percentage": 0.001,
    }
    if gang > 1:
        opts["gang_scheduling_config"] = {"gang_size": gang}
    if cluster.tp_size > 1:
        opts["placement_group_strategy"] = cluster.tp_placement_strategy
    name, size, most, waiting = "EngineServer", cluster.num_engines, options.max_engines, {}
    if role == "prefill":  # a disaggregated fleet's pools, each a deployment on its own signals
        name, size, most = "PrefillServer", cluster.prefill_engines, options.max_prefill_engines
        waiting = {"waiting_metric": "waiting_tokens",
                   "target_waiting_per_engine": options.target_waiting_tokens_per_prefill_engine}
    elif role == "decode":
        name, size, most = "DecodeServer", cluster.decode_engines, options.max_decode_engines
    elif options.autoscaled:
        size = options.min_engines
    if most is not None:
        opts["autoscaling_config"] = {
            "min_replicas": size, "max_replicas": most,
            "initial_replicas": size, "metrics_interval_s": 1.0, "look_back_period_s": 2.0,
            "upscale_delay_s": options.upscale_delay_s, "downscale_delay_s": options.downscale_delay_s,
            "policy": {"policy_function": EngineAutoscaler, "policy_kwargs": {
                "target_waiting_per_engine": options.target_waiting_per_engine,
                "target_kv_use": options.target_kv_use, "gang_size": gang, **waiting}},
        }
    else:
        opts["num_replicas"] = size
    return serve.deployment(EngineServer, name=name, **opts)
