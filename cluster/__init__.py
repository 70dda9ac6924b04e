"""The cluster as a whole: config, engine actors, routing, batch job, benchmarks, CLI."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.cluster import Cluster, ensure_ray
    from cluster.config import ClusterConfig

__all__ = ["Cluster", "ClusterConfig", "ensure_ray"]

# Imported on first use: a Ray process that unpickles a class of one submodule (a batch job's
# SeenIds actor) does not import the engine and torch with Cluster.
_HOME = {"Cluster": "cluster.cluster", "ensure_ray": "cluster.cluster", "ClusterConfig": "cluster.config"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
