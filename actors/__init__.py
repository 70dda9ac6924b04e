"""Ray actors that host engine pieces.

The names below load on first use: a process that imports one module of the package (the DP
coordinator's imports actors.dp_coordinator) does not import the engine, and torch, with it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"EngineActor": "actors.engine_actor", "EngineInfo": "actors.protocol",
            "GenerateRequest": "actors.protocol"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
