"""`LoRAConfig`: the engine's adapter settings (SGLang's flag names), what `LoRAManager` reads and
where they are checked. `EngineConfig` has the same fields (its defaults are these) and builds one
with `LoRAConfig.from_engine_config`, so the fields have one meaning and one set of checks."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.errors import ConfigError

# The rank the slots hold when neither max_lora_rank nor any lora_paths adapter says (vLLM's default).
DEFAULT_MAX_LORA_RANK = 16


class LoRAPath(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One adapter given at start in its long form (SGLang's JSON form of a `--lora-paths` entry)."""

    # the PEFT adapter folder (adapter_config.json + adapter_model.safetensors or .bin)
    lora_path: str
    # never evicted from host memory, nor from its device slot once there
    pinned: bool = False


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Adapters served on top of the base model (docs: issue 31). The defaults accept every adapter
    in `lora_paths`: as many host-resident adapters as there are, their largest rank, their targets."""

    # adapters loaded at start: name -> PEFT folder (CLI: name=path), or {lora_path, pinned}
    lora_paths: dict[str, str | LoRAPath] = {}
    # the most distinct adapters in one batch (device slots; base-model requests take none)
    max_loras_per_batch: int = 8
    # adapters held in host memory (past it the least recently used unpinned idle one is
    # dropped, read again when needed); None: max(len(lora_paths), max_loras_per_batch)
    max_loaded_loras: int | None = None
    # the largest adapter rank the slots hold; None: the largest in lora_paths (16 without any)
    max_lora_rank: int | None = None
    # projections given adapter slots (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj,
    # or all; a string separates them by commas or spaces); None: the union of lora_paths' targets
    # (all without any)
    lora_target_modules: tuple[str, ...] | str | None = None

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ConfigError(
                f"max_loras_per_batch must be at least 1, got {self.max_loras_per_batch}"
            )
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            # Every adapter in a slot is host-resident too (a slot is reloaded from host memory).
            raise ConfigError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be at least max_loras_per_batch "
                f"({self.max_loras_per_batch})"
            )
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        pinned = [name for name, p in self.paths().items() if p.pinned]
        if len(pinned) > self.max_loras_per_batch - 1:
            # One slot must stay free to rotate, or unpinned adapters could never run.
            raise ConfigError(
                f"{len(pinned)} pinned adapters ({', '.join(pinned)}) need max_loras_per_batch of at "
                f"least {len(pinned) + 1}, got {self.max_loras_per_batch}"
            )
        for name in self.lora_paths:
            if not name or "=" in name:
                raise ConfigError(f"bad adapter name {name!r} in lora_paths")

    @classmethod
    def from_engine_config(cls, config: Any) -> LoRAConfig:
        """The LoRA fields of an EngineConfig (ConfigError: the checks above)."""
        return cls(**{f: getattr(config, f) for f in cls.__struct_fields__})

    def target_modules(self) -> tuple[str, ...] | None:
        """lora_target_modules as a tuple of names (None: unset)."""
        t = self.lora_target_modules
        if isinstance(t, str):
            return tuple(t.replace(",", " ").split())
        return t

    def paths(self) -> dict[str, LoRAPath]:
        """lora_paths with every entry in its long form."""
        return {name: _long_form(name, p) for name, p in self.lora_paths.items()}

    def loaded_capacity(self) -> int:
        """max_loaded_loras resolved."""
        if self.max_loaded_loras is not None:
            return self.max_loaded_loras
        return max(len(self.lora_paths), self.max_loras_per_batch)


def _long_form(name: str, p: str | LoRAPath | dict) -> LoRAPath:
    if isinstance(p, LoRAPath):
        return p
    if isinstance(p, dict):  # the JSON form of the command line
        try:
            return msgspec.convert(p, LoRAPath)
        except msgspec.ValidationError as e:
            raise ConfigError(f"lora_paths[{name!r}]: {e}") from None
    return LoRAPath(lora_path=p)
