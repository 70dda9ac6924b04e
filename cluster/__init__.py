"""The cluster as a whole: config, engine actors, routing, batch job, benchmarks, CLI."""

from cluster.cluster import Cluster, ensure_ray
from cluster.config import ClusterConfig

__all__ = ["Cluster", "ClusterConfig", "ensure_ray"]
