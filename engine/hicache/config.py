"""HiCacheConfig: what the prefix cache is built from (`CacheManager`), taken from the
EngineConfig fields of the same names (`from_engine_config`), where users set them and where each
field's help line is; the defaults and the checks are here, and EngineConfig takes both from here,
so the two never disagree. Built directly (tests, benchmarks), every field has its default."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Literal, get_args

import msgspec

from engine.errors import ConfigError
from engine.hicache.eviction import EVICTION_POLICIES

if TYPE_CHECKING:
    from engine.config import EngineConfig

WritePolicy = Literal["write_through", "write_back", "write_through_selective"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
WRITE_POLICIES = get_args(WritePolicy)
PREFETCH_POLICIES = get_args(PrefetchPolicy)


class HiCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The EngineConfig fields of the same names (their comments there are the flags' help)."""

    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: WritePolicy = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_path: str | None = None
    hicache_storage_page_size: int = 64
    hicache_storage_prefetch_policy: PrefetchPolicy = "wait_complete"
    hicache_storage_prefetch_timeout_s: float = 1.0
    radix_eviction_policy: str = "cost_aware"

    def __post_init__(self) -> None:
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(
                f"radix_eviction_policy must be one of {sorted(EVICTION_POLICIES)}, "
                f"got {self.radix_eviction_policy!r}"
            )
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ConfigError(f"hicache_write_policy must be one of {WRITE_POLICIES}")
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(f"hicache_storage_prefetch_policy must be one of {PREFETCH_POLICIES}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ConfigError("hicache_ratio must be > 0 and hicache_size >= 0")
        if self.enable_hierarchical_cache and not self.hicache_size and self.hicache_ratio <= 1:
            # The host tier also holds copies of what the pool holds (write-through): no larger
            # than the pool, it would add nothing (SGLang's rule too).
            raise ConfigError("hicache_ratio must be > 1 (the host tier holds the pool's KV too)")
        if self.hicache_storage_page_size < 1:
            raise ConfigError("hicache_storage_page_size must be >= 1")
        if self.hicache_storage_prefetch_timeout_s < 0:
            raise ConfigError("hicache_storage_prefetch_timeout_s must be >= 0")
        if self.hicache_storage_backend is not None:
            if not self.enable_hierarchical_cache:
                raise ConfigError("hicache_storage_backend needs enable_hierarchical_cache")
            if self.hicache_storage_backend == "file" and not self.hicache_storage_path:
                raise ConfigError("hicache_storage_backend 'file' needs hicache_storage_path")

    @classmethod
    def from_engine_config(cls, config: EngineConfig | Any) -> HiCacheConfig:
        """The fields of the same names from an EngineConfig (ConfigError as above)."""
        return cls(**{name: getattr(config, name) for name in cls.__struct_fields__})

    @property
    def is_default(self) -> bool:
        """The plain radix cache with the default eviction policy: what a CacheManager builds
        with no config."""
        return self == DEFAULTS


DEFAULTS = HiCacheConfig()


def model_identity(model_dir: str, quantization: str, extra: str = "") -> str:
    """What storage page keys are seeded with besides the KV layout: the checkpoint's contents
    (config.json and the weight files' names and sizes, not its path, so engines that load the
    same checkpoint from different folders share pages) and how its weights are computed."""
    h = hashlib.sha256()
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            h.update(f.read())
        for name in sorted(os.listdir(model_dir)):
            if name.endswith((".safetensors", ".gguf", ".bin")):
                h.update(f"|{name}:{os.path.getsize(os.path.join(model_dir, name))}".encode())
    except OSError:
        h.update(os.path.abspath(model_dir).encode())
    return f"{h.hexdigest()[:32]}|quantization={quantization}{extra}"
