"""One source of configuration: CLI flags come from the config structs, AppArgs nests them."""

from __future__ import annotations

import argparse

import pytest

from cluster.batch import build_parser
from cluster.cli import ENGINE_OWN_FIELDS, add_cluster_flags, cluster_config
from cluster.config import ClusterConfig
from engine.config import EngineConfig
from engine.errors import ConfigError


def test_every_config_field_has_a_flag():
    ap = argparse.ArgumentParser()
    cluster, engine = add_cluster_flags(ap)
    from engine.limits import RequestLimits  # flat: --max-body-bytes, ... (ClusterConfig.limits)

    assert set(cluster) == set(ClusterConfig.__struct_fields__) - {"engine", "limits"} | set(RequestLimits.__struct_fields__)
    assert set(engine) == set(EngineConfig.__struct_fields__) - set(ENGINE_OWN_FIELDS)


def test_flags_build_the_config_and_unset_flags_keep_defaults():
    ap = build_parser()
    args = ap.parse_args(["--input", "i", "--output", "o", "--model", "/m", "--engines", "3", "--routing",
                          "least_load", "--enable-dp-attention", "--max-total-tokens", "900", "--schedule-policy", "lpm"])
    cfg = cluster_config(args, *args.config_fields)
    assert (cfg.model_path, cfg.num_engines, cfg.routing, cfg.enable_dp_attention) == ("/m", 3, "least_load", True)
    assert cfg.engine == {"max_total_tokens": 900, "schedule_policy": "lpm"}
    assert cfg.cpus_per_engine == ClusterConfig().cpus_per_engine


@pytest.mark.parametrize("argv", [["--routing", "random"], ["--schedule-policy", "sjf"], ["--engines", "two"]])
def test_bad_choices_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--input", "i", "--output", "o", *argv])


def test_app_args_nest_the_cluster_config():
    from deploy.options import AppArgs

    args = AppArgs.from_dict({"num_engines": 2, "api_key": "k", "max_total_tokens": 700,
                              "engine": {"schedule_policy": "lpm"}})
    assert args.cluster.num_engines == 2 and args.http.api_key == "k"
    assert args.cluster.engine == {"schedule_policy": "lpm", "max_total_tokens": 700}
    assert {"num_engines", "api_key", "max_total_tokens", "max_restarts", "address"} <= AppArgs.flat_fields()
    with pytest.raises(ConfigError, match="unknown app argument"):
        AppArgs.from_dict({"num_engine": 2})
    with pytest.raises(ConfigError):
        AppArgs.from_dict({"routing": "random"})


def test_every_config_field_has_a_help_line():
    """Every flag's help comes from its field's comment (engine.flags.field_docs): a new field
    without one fails here."""
    from deploy.options import FleetOptions, HTTPOptions
    from engine.flags import add_struct_flags, field_docs
    from engine.limits import RequestLimits

    for cls in (EngineConfig, ClusterConfig, RequestLimits, HTTPOptions, FleetOptions):
        assert [f for f in cls.__struct_fields__ if not field_docs(cls).get(f)] == [], cls.__name__
    ap = argparse.ArgumentParser()
    add_struct_flags(ap, EngineConfig)
    help_text = " ".join(ap.format_help().split())
    assert "--enable-overlap-schedule schedule the next decode batch while the current one runs" in help_text
