"""LoRA adapters on one base model (issue 31): PEFT adapters read and validated (`adapter`), held
in host memory and device slots by name (`pool`; under tensor parallelism each rank's shards, rank
0 deciding every rank's slots), configured by `LoRAConfig` (`config`). The kernels that apply them
are `kernels.lora` (torch, C++) and `kernels.triton_lora`."""

from engine.lora.adapter import (
    PROJECTION_GROUPS,
    TARGET_MODULES,
    LoRAAdapter,
    LoRAAdapterError,
    LoRAModule,
    UnknownLoRAError,
    load_adapter,
)
from engine.lora.config import LoRAConfig, LoRAPath
from engine.lora.pool import (
    BASE_SLOT,
    LoRAManager,
    LoRAMemoryPool,
    LoRAReplica,
    LoRAShards,
    LoRASlotsFullError,
    PoolEvent,
)

__all__ = [
    "BASE_SLOT",
    "PROJECTION_GROUPS",
    "TARGET_MODULES",
    "LoRAAdapter",
    "LoRAAdapterError",
    "LoRAConfig",
    "LoRAManager",
    "LoRAMemoryPool",
    "LoRAModule",
    "LoRAPath",
    "LoRAReplica",
    "LoRAShards",
    "LoRASlotsFullError",
    "PoolEvent",
    "UnknownLoRAError",
    "load_adapter",
]
