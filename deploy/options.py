"""The app's configuration: the HTTP options, the fleet's shape and `AppArgs`, which nests them
with a ClusterConfig and reads their flat form (YAML `args`, `serve run ... key=value`, the CLI).
The front ends (deploy/app.py) and the engine replicas (deploy/engines.py) both build from it."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

import msgspec

from cluster import ClusterConfig
from cluster.config import ENGINE_OWN_FIELDS
from engine import EngineConfig
from engine.config import build_config
from engine.errors import ConfigError
from engine.limits import RequestLimits
from openai_api.params import DEFAULT_MAX_TOKENS


class FleetOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The shape of the served fleet: front-end replicas, engine replicas (fixed: the cluster's
    num_engines; or autoscaled between min_engines and max_engines) and how engines leave."""

    frontends: int = 1  # front-end (OpenAIServer) replicas
    # Set: the front ends autoscale between `frontends` and this on ongoing HTTP requests.
    max_frontends: int | None = None
    target_requests_per_frontend: float = 64.0  # front-end autoscaling target: ongoing HTTP requests per replica
    min_engines: int | None = None  # autoscale the engines between min_engines and max_engines (set both; None: num_engines)
    max_engines: int | None = None  # the most engines autoscaling starts
    # Autoscaling signals: scale up while an engine's waiting requests or KV use exceed these.
    target_waiting_per_engine: float = 2.0
    target_kv_use: float = 0.85  # engine autoscaling target: the fraction of KV slots in use
    upscale_delay_s: float = 3.0  # how long the signals must ask for more engines before one is added
    downscale_delay_s: float = 30.0  # how long they must ask for fewer before one drains
    # Scale-down drain: requests without a token after this long are re-routed; the engine
    # stops after its last request, or at drain_timeout_s (the rest then end with an error).
    drain_reroute_after_s: float = 10.0
    drain_timeout_s: float = 120.0  # a draining engine stops at this point at the latest
    # Prefill/decode disaggregation: set, a pool autoscales between its size (prefill_engines,
    # decode_engines) and this, on its own signals (prefill: prompt tokens waiting per engine;
    # decode: waiting requests and pre-allocations, and KV use, as target_waiting_per_engine and target_kv_use).
    max_prefill_engines: int | None = None  # disaggregation: the prefill pool autoscales up to this many engines
    max_decode_engines: int | None = None  # disaggregation: the decode pool autoscales up to this many engines
    target_waiting_tokens_per_prefill_engine: float = 4096.0  # prefill pool autoscaling target: prompt tokens waiting per engine

    def __post_init__(self) -> None:
        if self.frontends < 1:
            raise ConfigError("frontends must be >= 1")
        if self.max_frontends is not None and self.max_frontends < self.frontends:
            raise ConfigError("max_frontends must be >= frontends")
        if (self.min_engines is None) != (self.max_engines is None):
            raise ConfigError("set min_engines and max_engines together (or neither: num_engines)")
        if self.min_engines is not None and not 1 <= self.min_engines <= self.max_engines:
            raise ConfigError("need 1 <= min_engines <= max_engines")
        if self.drain_reroute_after_s > self.drain_timeout_s:
            raise ConfigError("drain_reroute_after_s must be <= drain_timeout_s")

    @property
    def autoscaled(self) -> bool:
        return self.min_engines is not None


class HTTPOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What only the HTTP app needs; everything else is the ClusterConfig it nests."""

    api_key: str | None = None  # or RADIXRAY_API_KEY in the replica's environment
    served_model_name: str | None = None  # the model name clients send and /v1/models lists; None: the checkpoint folder's name (radixray-builtin for the built-in model)
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # max_tokens of a request that sets none
    # How tool calls are parsed out of chat outputs for tool_choice "auto" (openai_api.tool_parsers:
    # the same names as TOOL_PARSERS); None: "auto" with tools is refused.
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # /metrics serves the engines' and the fleet's figures as fetched at most this many seconds
    # ago (one fetch per interval per front end, whatever the scrape rate).
    metrics_refresh_s: float = 1.0
    # POST /v1/load_lora_adapter loads only adapter folders under this folder (as each front end
    # sees it: a path leaving it, symbolic links resolved, is a 400); None: loading and unloading
    # LoRA adapters at run time is refused (lora_paths still loads them at start)
    allowed_lora_root: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.metrics_refresh_s < math.inf:  # nan too: the cache would refresh on every scrape or never
            raise ConfigError(f"metrics_refresh_s must be a number of seconds > 0, got {self.metrics_refresh_s!r}")


class AppArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What the app is built from: a ClusterConfig, the HTTP options and the fleet's shape,
    nested. Its flat form (YAML `args`, `serve run ... key=value`, the CLI) uses their field
    names side by side, with EngineConfig's fields flat or under `engine` and the request limits
    (RequestLimits: max_body_bytes, ...) flat or under `limits`."""

    cluster: ClusterConfig
    http: HTTPOptions
    fleet: FleetOptions = FleetOptions()

    @classmethod
    def flat_fields(cls) -> set[str]:
        engine = set(EngineConfig.__struct_fields__) - set(ENGINE_OWN_FIELDS)
        return (set(ClusterConfig.__struct_fields__) | set(HTTPOptions.__struct_fields__)
                | set(FleetOptions.__struct_fields__) | set(RequestLimits.__struct_fields__) | engine)

    @classmethod
    def from_dict(cls, args: dict[str, Any] | None) -> AppArgs:
        # Renamed fields' old names (ClusterConfig's, EngineConfig's flat or under `engine`) warn here.
        args = EngineConfig.rename_kwargs(ClusterConfig.rename_kwargs(dict(args or {})))
        unknown = sorted(set(args) - cls.flat_fields() - {"engine"})
        if unknown:
            raise ConfigError(f"unknown app argument(s): {', '.join(unknown)}")
        http = {k: args.pop(k) for k in list(args) if k in HTTPOptions.__struct_fields__}
        fleet = {k: args.pop(k) for k in list(args) if k in FleetOptions.__struct_fields__}
        if http.get("api_key") is None and os.environ.get("RADIXRAY_API_KEY"):
            http["api_key"] = os.environ["RADIXRAY_API_KEY"]
        engine = dict(args.pop("engine", None) or {})
        engine_fields = set(EngineConfig.__struct_fields__) - set(ENGINE_OWN_FIELDS)
        engine.update({k: args.pop(k) for k in list(args) if k in engine_fields})
        typed = msgspec.structs.asdict(build_config(EngineConfig, "engine", engine, strict=False))
        engine = {k: typed[k] for k in engine}
        # Not strict: `serve run deploy.app:build_app num_engines=2` passes strings.
        cluster = ClusterConfig.from_kwargs(strict=False, **args, engine=engine)
        fleet_options = build_config(FleetOptions, "fleet", fleet, strict=False)
        if cluster.disaggregated and cluster.enable_dp_attention:
            raise ConfigError("attention-DP decode engines behind Serve are not supported yet (the Python "
                              "Cluster takes them)")
        if cluster.disaggregated and fleet_options.autoscaled:
            raise ConfigError("min_engines/max_engines size unified engines; a disaggregated fleet's pools "
                              "autoscale up to max_prefill_engines and max_decode_engines")
        for pool, size, most in (("prefill", cluster.prefill_engines, fleet_options.max_prefill_engines),
                                 ("decode", cluster.decode_engines, fleet_options.max_decode_engines)):
            if most is not None and (not cluster.disaggregated or most < size):
                raise ConfigError(f"max_{pool}_engines needs {pool}_engines set, and at most max_{pool}_engines")
        if cluster.enable_dp_attention and fleet_options.autoscaled:
            size = cluster.dp_group_size or cluster.num_engines
            if fleet_options.min_engines % size or fleet_options.max_engines % size:
                raise ConfigError(f"min_engines and max_engines must be multiples of the DP group size ({size})")
        return cls(cluster=cluster, http=build_config(HTTPOptions, "http", http, strict=False), fleet=fleet_options)
