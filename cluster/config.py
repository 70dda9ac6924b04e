"""ClusterConfig: the cluster as a whole (frozen, validated; CLI flags and YAML share its names)."""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import msgspec

from cluster.routing import POLICIES, ROUTING_POLICIES, RoutingName
from engine import EngineConfig
from engine.config import (
    MOE_SPLITS,
    ModelConfig,
    MoeSplit,
    RenamingMeta,
    build_config,
    rename_fields,
)
from engine.errors import ConfigError
from engine.limits import RequestLimits
from engine.model_path import MODEL_NAMES

# EngineConfig fields the cluster sets for every engine itself (not per-engine overrides).
ENGINE_OWN_FIELDS = ("model_path", "device", "torch_threads", "moe_split", "limits", "tp_size")


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=RenamingMeta):
    """The cluster: its engines, how requests are routed to them, and the engine overrides. Fields
    are named by EngineConfig's rule; the old names in `renamed_fields` (and EngineConfig's, under
    `engine`) still work with a DeprecationWarning."""

    renamed_fields: ClassVar[MappingProxyType] = MappingProxyType({
        "dp_attention": "enable_dp_attention",  # SGLang's name
    })

    model_path: str | None = None  # HF checkpoint folder, a GGUF file, or a model name (builtin, builtin-moe, smollm2-135m-instruct); None: the built-in noise model
    num_engines: int = 1  # engine actors (one per GPU, or one per cpus_per_engine CPUs)
    # Prefill/decode disaggregation (both or neither; num_engines is then their sum): engines that
    # compute prompts and send their KV, and engines that fetch it and decode.
    prefill_engines: int = 0  # disaggregation: engines that compute prompts and send their KV to decode engines
    decode_engines: int = 0  # disaggregation: engines that fetch each request's KV from a prefill engine and decode
    routing: RoutingName = "kv_events"  # the engines' own KV events: one exact view for every front end
    # The routing policy's fields, e.g. {"prefill_weight": 1.0, "load_weight": 0.1} for kv_events.
    routing_options: dict[str, float] = {}
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when the Ray cluster has GPUs
    cpus_per_engine: float = 1.0  # CPUs of each engine (CPU engines), shared by its tensor-parallel ranks
    torch_threads_per_engine: int | None = None  # torch threads of each engine rank; default: its CPU share rounded up
    # Tensor parallelism (SGLang's name): each engine is this many ranks (Ray actors, one GPU or a
    # 1/tp_size share of cpus_per_engine each) in a placement group of its own, restarted as a gang.
    tp_size: int = 1
    tp_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "STRICT_PACK"  # how one engine's ranks are placed (tp_size > 1)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # how the engines' bundles are placed over the Ray nodes
    max_restarts: int = -1  # Ray restarts a dead engine actor (-1: forever)
    request_timeout_s: float = 600.0  # a request still running after this ends with a timeout error (HTTP 504)
    # A stream's tokens after its first go out at most once per interval, merged into one delta
    # (one SSE event): the first token and the end are never held. 0: every engine step. Half of
    # the 0.1 s a reader takes as instantaneous, and several tokens per event at GPU token rates.
    stream_interval_s: float = 0.05
    health_check_period_s: float = 1.0  # how often each engine is checked (and its evictions read)
    engine: dict[str, Any] = {}  # EngineConfig overrides, with EngineConfig's field names
    enable_dp_attention: bool = False  # attention-DP: groups of dp_group_size engines step together and share the MLP work
    dp_group_size: int | None = None  # engines per attention-DP group; None: all of them
    # Attention-DP with an MoE model: "experts" gives each member E/G whole experts (expert
    # parallelism; num_experts must divide by G), "intermediate" a slice of every expert.
    moe_split: MoeSplit = "experts"
    # Attention-DP: a member that had work but took no step, or has not checked in with its
    # group's coordinator, for this many seconds fails its health check (and its group restarts).
    dp_stall_timeout_s: float = 30.0
    address: str | None = None  # Ray address; None: RAY_ADDRESS or a new local cluster
    # Request size limits (engine/limits.py), checked before any work is done for a request: by
    # every engine, the front ends and the batch job. Their flat names (max_body_bytes, ...) are
    # accepted beside this struct's own (CLI flags, YAML args).
    limits: RequestLimits = RequestLimits()

    def __post_init__(self) -> None:
        if self.prefill_engines or self.decode_engines:
            self._check_disaggregation()
        if self.num_engines < 1:
            raise ConfigError("num_engines must be >= 1")
        if self.routing not in POLICIES:
            raise ConfigError(f"routing must be one of {POLICIES}, got {self.routing!r}")
        try:
            ROUTING_POLICIES[self.routing](**self.routing_options)
        except TypeError as e:
            raise ConfigError(f"routing_options do not fit routing={self.routing!r}: {e}") from None
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"placement_strategy {self.placement_strategy!r} is not a Ray strategy")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device must be auto, cpu or cuda")
        if not 0 <= self.stream_interval_s <= 1:
            raise ConfigError("stream_interval_s must be in [0, 1]")
        if self.cpus_per_engine <= 0:
            raise ConfigError("cpus_per_engine must be > 0")
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.tp_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"tp_placement_strategy {self.tp_placement_strategy!r} is not a Ray strategy")
        if self.tp_size > 1 and self.enable_dp_attention:
            raise ConfigError("tp_size > 1 with enable_dp_attention is not supported yet")
        lora = self.engine.get("enable_lora") or self.engine.get("lora_paths")
        if lora and self.tp_size > 1 and self.tp_placement_strategy != "STRICT_PACK":
            # every rank reads an adapter's folder itself, so they must see the same files
            raise ConfigError("LoRA adapters with tp_size > 1 need tp_placement_strategy='STRICT_PACK' "
                              "(the ranks on one node)")
        if not self.dp_stall_timeout_s > 0:
            raise ConfigError(f"dp_stall_timeout_s must be > 0, got {self.dp_stall_timeout_s!r}")
        for key in ENGINE_OWN_FIELDS:
            if key in self.engine:
                raise ConfigError(f"set {key!r} on the cluster, not in engine overrides")
        self.engine_config()  # validates the overrides' names and values now
        if self.dp_group_size is not None and (self.dp_group_size < 1 or self.dp_span[1] % self.dp_group_size):
            raise ConfigError("dp_group_size must divide num_engines (with disaggregation: decode_engines)")
        if self.moe_split not in MOE_SPLITS:
            raise ConfigError(f"moe_split must be one of {MOE_SPLITS}, got {self.moe_split!r}")
        if self.enable_dp_attention and self.moe_split == "experts":
            self._check_expert_split()

    def _check_disaggregation(self) -> None:
        pools = self.prefill_engines + self.decode_engines
        if self.prefill_engines < 1 or self.decode_engines < 1:
            raise ConfigError("prefill_engines and decode_engines must both be >= 1 (or both 0: unified engines)")
        if self.num_engines not in (1, pools):
            raise ConfigError(f"num_engines ({self.num_engines}) must be prefill_engines + decode_engines ({pools}) "
                              "or left out")
        if "disaggregation_mode" in self.engine:
            raise ConfigError("set prefill_engines and decode_engines, not disaggregation_mode in engine overrides")
        msgspec.structs.force_setattr(self, "num_engines", pools)

    @property
    def cpus_per_rank(self) -> float:
        """Each tensor-parallel rank's share of the engine's CPUs (its bundle on a CPU cluster)."""
        return self.cpus_per_engine / self.tp_size

    @property
    def disaggregated(self) -> bool:
        return self.prefill_engines > 0

    @property
    def dp_span(self) -> tuple[int, int]:
        """Attention-DP: the engines its groups are made of (first index, how many): a disaggregated
        cluster's decode engines (its prefill engines run alone), else every engine."""
        return (self.prefill_engines, self.decode_engines) if self.disaggregated else (0, self.num_engines)

    @property
    def dp_size(self) -> int:
        """Engines per attention-DP group."""
        return self.dp_group_size or self.dp_span[1]

    def engine_role(self, index: int) -> str:
        """Engine `index`'s disaggregation_mode: the first prefill_engines are prefill engines."""
        if not self.disaggregated:
            return "null"
        return "prefill" if index < self.prefill_engines else "decode"

    def _check_expert_split(self) -> None:
        """Expert parallelism needs num_experts divisible by the group size: said here, before any
        engine starts, when the checkpoint's config is readable from this process (each engine
        checks again when it loads its experts)."""
        size = self.dp_size
        path = self.model_path
        if size == 1 or path is None:  # None: the built-in dense model
            return
        if path not in MODEL_NAMES and not os.path.isfile(os.path.join(path, "config.json")):
            return
        experts = ModelConfig.from_dir(path).num_experts
        if experts and experts % size:
            raise ConfigError(f"moe_split='experts' needs num_experts ({experts}) divisible by the DP group "
                              f"size ({size}); use moe_split='intermediate' or another dp_group_size")

    @classmethod
    def rename_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Old names to new, the engine overrides' too (so every engine gets the new names)."""
        kwargs = rename_fields(cls, kwargs)
        if isinstance(kwargs.get("engine"), dict):
            kwargs = {**kwargs, "engine": EngineConfig.rename_kwargs(kwargs["engine"])}
        return kwargs

    @classmethod
    def from_kwargs(cls, strict: bool = True, **kwargs: Any) -> ClusterConfig:
        """The limits may come flat (max_body_bytes=...) or as `limits` (a dict or a RequestLimits)."""
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in RequestLimits.__struct_fields__}
        if flat:
            base = kwargs.get("limits") or {}
            if isinstance(base, RequestLimits):
                base = msgspec.structs.asdict(base)
            kwargs["limits"] = {**base, **flat}
        return build_config(cls, "cluster", kwargs, strict)

    def engine_config(self, device: str | None = None, role: str = "null") -> EngineConfig:
        """An engine's config; role: its disaggregation_mode (engine_role)."""
        threads = self.torch_threads_per_engine or max(1, int(-(-self.cpus_per_rank // 1)))
        own = {"model_path": self.model_path, "device": device or self.device, "torch_threads": threads,
               "moe_split": self.moe_split, "limits": self.limits, "tp_size": self.tp_size}
        if role != "null":
            own["disaggregation_mode"] = role
        return EngineConfig.from_kwargs(**{**self.engine, **own})
