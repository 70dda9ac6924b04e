"""Ray actors that host engine pieces."""

from actors.engine_actor import EngineActor
from actors.protocol import EngineInfo, GenerateRequest

__all__ = ["EngineActor", "EngineInfo", "GenerateRequest"]
