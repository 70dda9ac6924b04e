"""Command-line flags generated from the config structs: one flag per field, same name with
dashes, typed and (for Literal fields) with choices, so no CLI re-declares a config field."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from cluster.config import ENGINE_OWN_FIELDS, ClusterConfig
from engine.config import EngineConfig

RENAMES = {"model_path": "model", "num_engines": "engines"}  # the short flags users know
HELP = {  # where the default says too little
    "model_path": "HF checkpoint folder (default: the built-in noise model)",
    "api_key": "require this bearer token (default: $RADIXRAY_API_KEY, else none)",
    "address": "Ray address (default: $RAY_ADDRESS, else a new local cluster)",
    "max_total_tokens": "KV slots per engine (default: from the memory budget)",
    "request_timeout_s": "end a request after this many seconds (default: 600)",
    "routing_options": 'the routing policy\'s fields as JSON, e.g. \'{"load_weight": 0.2}\' for kv_events',
}


def _scalar(t: msgspec.inspect.Type) -> msgspec.inspect.Type | None:
    """The one non-None member of an optional type; None for types a flag cannot carry."""
    if isinstance(t, msgspec.inspect.UnionType):
        members = [m for m in t.types if not isinstance(m, msgspec.inspect.NoneType)]
        return _scalar(members[0]) if len(members) == 1 else None
    kinds = (msgspec.inspect.BoolType, msgspec.inspect.IntType, msgspec.inspect.FloatType,
             msgspec.inspect.StrType, msgspec.inspect.LiteralType, msgspec.inspect.DictType)
    return t if isinstance(t, kinds) else None


def add_struct_flags(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = (),
                     renames: dict[str, str] | None = None) -> list[str]:
    """Add --field-name for each field of `cls` a flag can carry; defaults are None (unset), so
    only the flags given override the struct's own defaults. Returns the fields added."""
    renames = renames or {}
    added = []
    for f in msgspec.inspect.type_info(cls).fields:
        t = _scalar(f.type)
        if f.name in skip or t is None:
            continue
        if isinstance(t, msgspec.inspect.BoolType) and f.default is True:
            raise TypeError(f"{cls.__name__}.{f.name} defaults to True: a store_true flag cannot turn it off")
        flag = "--" + renames.get(f.name, f.name).replace("_", "-")
        default = f.default if f.default is not msgspec.NODEFAULT else None
        help_text = HELP.get(f.name, f"default: {default}")
        if isinstance(t, msgspec.inspect.BoolType):
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
        elif isinstance(t, msgspec.inspect.LiteralType):
            parser.add_argument(flag, dest=f.name, choices=list(t.values), default=None, help=help_text)
        elif isinstance(t, msgspec.inspect.DictType):  # a JSON object, e.g. '{"load_weight": 0.2}'
            parser.add_argument(flag, dest=f.name, type=msgspec.json.decode, default=None,
                                help=HELP.get(f.name, "a JSON object"))
        else:
            kind = {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float}.get(type(t), str)
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)
        added.append(f.name)
    return added


def given(args: argparse.Namespace, fields: list[str]) -> dict[str, Any]:
    """The fields whose flags were given."""
    return {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}


def add_cluster_flags(ap: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """ClusterConfig's and EngineConfig's fields as flags; returns (cluster fields, engine fields)."""
    cluster = add_struct_flags(ap.add_argument_group("cluster options (ClusterConfig)"), ClusterConfig,
                               skip=("engine",), renames=RENAMES)
    engine = add_struct_flags(ap.add_argument_group("engine options (EngineConfig)"), EngineConfig,
                              skip=ENGINE_OWN_FIELDS)
    return cluster, engine


def cluster_config(args: argparse.Namespace, cluster: list[str], engine: list[str]) -> ClusterConfig:
    return ClusterConfig.from_kwargs(**given(args, cluster), engine=given(args, engine))
